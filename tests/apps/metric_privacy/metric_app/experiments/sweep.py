"""A sweep over the privacy modes, run by hand (never by the Flower app)."""

from metric_app.strategy_factory import PRIVACY_MODES, make_strategy

BASELINE = make_strategy("fedprox", "global-dp", num_clients=8, noise_multiplier=0.01, clipping_norm=1.0)


def main():
    for privacy in PRIVACY_MODES:
        make_strategy("fedprox", privacy, num_clients=8, noise_multiplier=0.01, clipping_norm=1.0)


if __name__ == "__main__":
    main()

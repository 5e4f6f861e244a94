"""The privacy wrapper the run config selects."""

from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping

from privacy_wrappers.metric import MetricPrivacyServerSideFixedClipping


def wrap(strategy, run_config):
    privacy = run_config["privacy"]
    if privacy == "metric-privacy":
        return MetricPrivacyServerSideFixedClipping(strategy, noise_multiplier=0.5, clipping_norm=1.0)
    elif privacy == "global-dp":
        return DifferentialPrivacyServerSideFixedClipping(
            strategy, noise_multiplier=run_config["noise"], clipping_norm=run_config["clip"], num_sampled_clients=5
        )
    return strategy

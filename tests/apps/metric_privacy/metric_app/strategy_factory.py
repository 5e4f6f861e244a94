"""The aggregation strategy and the privacy wrapper the run config selects."""

from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg, FedProx

from metric_app.metric_strategy import MetricPrivacyServerSideFixedClipping

PRIVACY_MODES = ("vanilla", "global-dp", "metric-privacy")


def make_base_strategy(aggregation, *, num_clients):
    if aggregation == "fedavg":
        return FedAvg(min_train_nodes=num_clients)
    if aggregation == "fedprox":
        return FedProx(min_train_nodes=num_clients, proximal_mu=0.5)
    raise ValueError(aggregation)


def make_strategy(aggregation, privacy, *, num_clients, noise_multiplier, clipping_norm):
    strategy = make_base_strategy(aggregation, num_clients=num_clients)
    if privacy == "vanilla":
        return strategy
    if privacy == "global-dp":
        return DifferentialPrivacyServerSideFixedClipping(
            strategy=strategy,
            noise_multiplier=noise_multiplier,
            clipping_norm=clipping_norm,
            num_sampled_clients=num_clients,
        )
    if privacy == "metric-privacy":
        return MetricPrivacyServerSideFixedClipping(
            strategy=strategy,
            noise_multiplier=noise_multiplier,
            clipping_norm=clipping_norm,
            num_sampled_clients=num_clients,
        )
    raise ValueError(f"unknown privacy mode {privacy!r}")

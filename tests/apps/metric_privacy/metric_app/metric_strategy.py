"""The app's own server-side wrapper: it clips the updates and perturbs the aggregate with its own metric."""

from flwr.serverapp.strategy import Strategy


class MetricPrivacyServerSideFixedClipping(Strategy):
    def __init__(self, strategy, noise_multiplier, clipping_norm, num_sampled_clients):
        self.strategy = strategy
        self.noise_multiplier, self.clipping_norm = noise_multiplier, clipping_norm
        self.num_sampled_clients = num_sampled_clients

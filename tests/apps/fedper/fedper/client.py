"""FedPer's clients: FedAvg's sends the whole model, FedPer's the body alone (rankaudit never runs it)."""
from flwr.client import NumPyClient
from torch.utils.data import DataLoader

from fedper.implemented_models.mobile_model import MobileNetModelManager


class BaseClient(NumPyClient):
    def __init__(self, trainloader, config, model_manager_class):
        super().__init__()
        self.config = config
        self.num_epochs = self.config["num_epochs"]
        self.model_manager = model_manager_class(
            config=config, trainloader=trainloader, learning_rate=self.config["learning_rate"]
        )

    def get_parameters(self, config):
        return [val.cpu().numpy() for val in self.model_manager.model.state_dict().values()]

    def fit(self, parameters, config):
        self.model_manager.train(epochs=self.num_epochs)
        return self.get_parameters(config), len(self.model_manager.trainloader), {}


class FedPerClient(BaseClient):
    def get_parameters(self, config):
        """The body alone: the head stays on the client."""
        return [val.cpu().numpy() for _, val in self.model_manager.model.body.state_dict().items()]


def get_client_fn_simulation(config, client_state_save_path=""):
    def client_fn(cid: str):
        trainloader = DataLoader([], config.batch_size, shuffle=True)
        if client_state_save_path != "":
            return FedPerClient(trainloader=trainloader, config=config, model_manager_class=MobileNetModelManager)
        return BaseClient(trainloader=trainloader, config=config, model_manager_class=MobileNetModelManager)

    return client_fn

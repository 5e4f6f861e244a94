"""fedrep: the ClientApp; FedRep's client sends the body and keeps its head (rankaudit never runs it)."""
from flwr.client import ClientApp, NumPyClient
from flwr.common import Context

from .constants import Algorithm
from .utils import get_model_manager_class


class BaseClient(NumPyClient):
    def __init__(self, model_manager):
        super().__init__()
        self.model_manager = model_manager

    def get_parameters(self, config):
        return self.model_manager.model.get_parameters()

    def fit(self, parameters, config):
        self.model_manager.train()
        return self.get_parameters(config), len(self.model_manager.trainloader.dataset), {}


class FedRepClient(BaseClient):
    def get_parameters(self, config):
        """The body alone: the head stays on the client."""
        return [val.cpu().numpy() for val in self.model_manager.model.body.state_dict().values()]


def client_fn(context: Context):
    model_manager_class = get_model_manager_class(context)
    algorithm = str(context.run_config["algorithm"]).lower()
    trainloader = load_partition(context)
    if algorithm == Algorithm.FEDAVG.value:
        client_class = BaseClient
    elif algorithm == Algorithm.FEDREP.value:
        client_class = FedRepClient
    else:
        raise RuntimeError(f"Unknown algorithm {algorithm}.")
    return client_class(model_manager_class(context=context, trainloader=trainloader)).to_client()


def load_partition(context):
    from torch.utils.data import DataLoader

    return DataLoader([], batch_size=int(context.run_config["batch-size"]), shuffle=True)


app = ClientApp(client_fn)

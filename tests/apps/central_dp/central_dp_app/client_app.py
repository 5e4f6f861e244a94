"""central_dp_app: the ClientApp with the SecAgg+ and clipping mods (imports flwr; never run by rankaudit)."""
from flwr.client import ClientApp, NumPyClient
from flwr.client.mod import fixedclipping_mod, secaggplus_mod

from central_dp_app.task import Net, load_data, train


class FlowerClient(NumPyClient):
    def fit(self, parameters, config):
        net = Net()
        trainloader, _ = load_data()
        train(net, trainloader)
        return [p.detach().numpy() for p in net.parameters()], 64, {}


app = ClientApp(client_fn=lambda context: FlowerClient().to_client(), mods=[secaggplus_mod, fixedclipping_mod])

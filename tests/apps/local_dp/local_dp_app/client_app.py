"""local_dp_app: the ClientApp with LocalDpMod (imports flwr; never run by rankaudit)."""
from flwr.client import ClientApp
from flwr.client.mod import LocalDpMod

from local_dp_app.task import Net, load_data

local_dp_mod = LocalDpMod(2.0, 1.0, 1.0, 1e-5)
app = ClientApp(client_fn=None, mods=[local_dp_mod])

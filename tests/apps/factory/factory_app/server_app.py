"""factory_app: the ServerApp (never run by rankaudit)."""
from flwr.serverapp import ServerApp

app = ServerApp()

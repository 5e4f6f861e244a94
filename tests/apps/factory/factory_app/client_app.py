"""factory_app: the ClientApp (never run by rankaudit)."""

from flwr.clientapp import ClientApp

app = ClientApp()

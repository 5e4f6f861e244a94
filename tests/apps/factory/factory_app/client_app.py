"""factory_app: the ClientApp (never run by rankaudit)."""
from flwr.clientapp import ClientApp

from factory_app.task import LogisticRegression, get_model

app = ClientApp()

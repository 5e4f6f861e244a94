"""The ServerApp (rankaudit never runs it)."""

from flwr.serverapp import ServerApp

app = ServerApp()

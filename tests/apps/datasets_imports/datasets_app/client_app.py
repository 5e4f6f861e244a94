"""The ClientApp (rankaudit never runs it)."""

from flwr.clientapp import ClientApp

from datasets_app.task import Net, load_data, train

app = ClientApp()


@app.train()
def fit(msg, context):
    net = Net()
    train(net, load_data(0, 2), context.run_config["local-epochs"], 0.1)

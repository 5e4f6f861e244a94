"""quickstart_app: the ClientApp (imports flwr; rankaudit never runs it)."""
from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp import ClientApp

from quickstart_app.task import Net, load_data
from quickstart_app.task import train as train_fn

app = ClientApp()


@app.train()
def train(msg: Message, context: Context):
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    batch_size = context.run_config["batch-size"]
    trainloader, _ = load_data(context.node_config["partition-id"], context.node_config["num-partitions"], batch_size)
    train_fn(model, trainloader, context.run_config["local-epochs"], msg.content["config"]["lr"], "cpu")
    return Message(content={"arrays": ArrayRecord(model.state_dict())}, reply_to=msg)

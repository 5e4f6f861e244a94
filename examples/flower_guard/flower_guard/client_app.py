"""The quickstart's ClientApp, with the rankaudit guard as a mod: each update is checked before it leaves."""

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flower_guard.task import Net, load_data
from flower_guard.task import test as test_fn
from flower_guard.task import train as train_fn
from rankaudit.guard.flower import rankaudit_guard


def local_samples(context: Context):
    """What the train handler trains on: load_data's (trainloader, testloader); the guard takes the first."""
    return load_data(context.node_config["partition-id"], context.node_config["num-partitions"])


app = ClientApp(mods=[rankaudit_guard(Net, local_samples)])


@app.train()
def train(msg: Message, context: Context):
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    device = torch.device("cpu")
    trainloader, _ = load_data(context.node_config["partition-id"], context.node_config["num-partitions"])
    train_loss = train_fn(model, trainloader, context.run_config["local-epochs"], msg.content["config"]["lr"], device)
    metrics = MetricRecord({"train_loss": train_loss, "num-examples": len(trainloader.dataset)})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context):
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    _, testloader = load_data(context.node_config["partition-id"], context.node_config["num-partitions"])
    loss, accuracy = test_fn(model, testloader, torch.device("cpu"))
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": accuracy, "num-examples": len(testloader.dataset)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)

"""flpa: the ClientApp (imports flwr; rankaudit never runs it)."""
from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp import ClientApp

from flpa.task import Net, train

app = ClientApp()


@app.train()
def train_step(msg: Message, context: Context):
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    trainloader = load_partition(context.node_config["partition-id"], context.run_config["batch-size"])
    train(model, trainloader, context.run_config["local-epochs"], context.run_config["lr"])
    return Message(content={"arrays": ArrayRecord(model.state_dict())}, reply_to=msg)


def load_partition(partition_id, batch_size):
    from flwr_datasets import FederatedDataset
    from torch.utils.data import DataLoader

    partition = FederatedDataset(dataset="ylecun/mnist", partitioners={"train": 10}).load_partition(partition_id)
    return DataLoader(partition.with_format("torch"), batch_size=batch_size, shuffle=True)

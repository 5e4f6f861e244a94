"""opacus_app: DP-SGD with Opacus' make_private on each client (imports flwr and opacus; never run by rankaudit)."""
import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from opacus import PrivacyEngine

from opacus_app.task import Net

app = ClientApp()


@app.train()
def train(msg: Message, context: Context):
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    train_loader = torch.utils.data.DataLoader(msg.content["data"], batch_size=context.run_config["batch-size"])
    max_grad_norm = float(context.run_config["max-grad-norm"])
    privacy_engine = PrivacyEngine(secure_mode=False)
    model, optimizer, train_loader = privacy_engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=train_loader,
        noise_multiplier=1.1,
        max_grad_norm=max_grad_norm,
    )
    for _ in range(context.run_config["local-epochs"]):
        for x, y in train_loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    return msg

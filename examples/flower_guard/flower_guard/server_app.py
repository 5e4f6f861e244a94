"""The quickstart's ServerApp: FedAvg over the clients' updates (a blocked one arrives as a failure)."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from flower_guard.task import Net

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    torch.manual_seed(0)
    strategy = FedAvg(fraction_train=context.run_config["fraction-train"])
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(Net().state_dict()),
        train_config=ConfigRecord({"lr": context.run_config["lr"]}),
        num_rounds=context.run_config["num-server-rounds"],
    )

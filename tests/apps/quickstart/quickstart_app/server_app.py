"""quickstart_app: the ServerApp (imports flwr; rankaudit never runs it)."""
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from quickstart_app.task import Net

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    fraction_train: float = context.run_config["fraction-train"]
    num_rounds: int = context.run_config["num-server-rounds"]
    lr: float = context.run_config["learning-rate"]
    strategy = FedAvg(fraction_train=fraction_train)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()),
                   train_config=ConfigRecord({"lr": lr}), num_rounds=num_rounds)

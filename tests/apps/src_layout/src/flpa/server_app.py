"""flpa: the ServerApp (imports flwr; rankaudit never runs it)."""
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from flpa.task import Net

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    strategy = FedAvg(fraction_train=1.0)
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(Net().state_dict()),
        num_rounds=context.run_config["num-server-rounds"],
    )

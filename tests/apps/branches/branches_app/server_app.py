"""The branches app's ServerApp: the privacy wrapper comes from the sibling package (rankaudit never runs it)."""

from flwr.serverapp import ServerApp
from flwr.serverapp.strategy import FedAvg

from privacy_wrappers.select import wrap

app = ServerApp()


@app.main()
def main(grid, context):
    strategy = wrap(FedAvg(fraction_train=0.5), context.run_config)
    strategy.start(grid=grid, num_rounds=context.run_config["num-server-rounds"])

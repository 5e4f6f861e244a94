"""The metric app's ServerApp (imports flwr; rankaudit never runs it)."""

from flwr.serverapp import ServerApp

from metric_app.strategy_factory import make_strategy

app = ServerApp()


@app.main()
def main(grid, context):
    config = context.run_config
    strategy = make_strategy(
        config["aggregation"],
        config["privacy"],
        num_clients=config["num-clients"],
        noise_multiplier=config["noise-multiplier"],
        clipping_norm=config["clipping-norm"],
    )
    strategy.start(grid=grid, num_rounds=config["num-server-rounds"])

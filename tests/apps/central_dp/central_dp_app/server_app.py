"""central_dp_app: central DP with client-side clipping and server-side noise, over SecAgg+ (never run by rankaudit)."""
from flwr.common import Context
from flwr.server import Grid, LegacyContext, ServerApp, ServerConfig
from flwr.server.strategy import DifferentialPrivacyClientSideFixedClipping, FedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    num_sampled_clients = context.run_config["num-sampled-clients"]
    strategy = FedAvg(fraction_fit=0.2, min_fit_clients=4)
    strategy = DifferentialPrivacyClientSideFixedClipping(
        strategy,
        noise_multiplier=context.run_config["noise-multiplier"],
        clipping_norm=context.run_config["clipping-norm"],
        num_sampled_clients=num_sampled_clients,
    )
    context = LegacyContext(context=context, config=ServerConfig(num_rounds=3), strategy=strategy)
    workflow = DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(
        num_shares=context.run_config["num-shares"],
        reconstruction_threshold=context.run_config["reconstruction-threshold"]))
    workflow(grid, context)

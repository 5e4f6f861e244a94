"""A FedAvgJob with a ScriptRunner on each site, for rankaudit's tests (rankaudit reads it, never runs it)."""

from src.network import TinyNetwork

from nvflare.app_opt.pt.job_config.fed_avg import FedAvgJob
from nvflare.job_config.script_runner import ScriptRunner

if __name__ == "__main__":
    n_clients = 2
    num_rounds = 5
    train_script = "src/local_train.py"

    job = FedAvgJob(name="fedavg-job", n_clients=n_clients, num_rounds=num_rounds, initial_model=TinyNetwork())
    for site in range(n_clients):
        runner = ScriptRunner(script=train_script, script_args="--local_epochs 2")
        job.to(runner, f"site-{site + 1}")
    job.simulator_run("/tmp/nvflare/jobs/fedavg-job", gpu="0")

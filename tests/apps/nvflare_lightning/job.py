"""NVFlare's hello-lightning job (Recipe API), trimmed to what rankaudit reads; for rankaudit's tests."""

import argparse

from model import LitNet

from nvflare.app_opt.pt.recipes.fedavg import FedAvgRecipe
from nvflare.recipe.sim_env import SimEnv


def define_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n_clients", type=int, default=2)
    parser.add_argument("--num_rounds", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=24)
    parser.add_argument("--limit_batches", type=int, default=0)
    parser.add_argument("--synthetic_data", action="store_true")
    return parser.parse_args()


def main():
    args = define_parser()
    n_clients = args.n_clients
    num_rounds = args.num_rounds
    batch_size = args.batch_size
    train_args = f"--batch_size {batch_size} --limit_batches {args.limit_batches}" + (
        " --synthetic_data" if args.synthetic_data else ""
    )
    recipe = FedAvgRecipe(
        name="hello-lightning-fedavg",
        min_clients=n_clients,
        num_rounds=num_rounds,
        model=LitNet(),
        train_script="client.py",
        train_args=train_args,
    )
    env = SimEnv(num_clients=n_clients, num_threads=n_clients)
    recipe.execute(env=env)


if __name__ == "__main__":
    main()

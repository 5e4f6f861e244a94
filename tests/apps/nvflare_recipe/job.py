"""An NVFlare job written with the Recipe API, for rankaudit's tests (rankaudit reads it, never runs it)."""

import argparse

from model import CNN

from nvflare.app_opt.pt.recipes.fedavg import FedAvgRecipe
from nvflare.recipe import SimEnv


def define_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n_clients", type=int, default=3)
    parser.add_argument("--num_rounds", type=int, default=5)
    parser.add_argument("--batch_size", type=int, default=16)
    return parser.parse_args()


def main():
    args = define_parser()
    n_clients = args.n_clients
    batch_size = args.batch_size
    recipe = FedAvgRecipe(
        name="recipe-job",
        min_clients=n_clients,
        num_rounds=args.num_rounds,
        model=CNN(num_classes=4),
        train_script="client.py",
        train_args=f"--batch_size {batch_size} --epochs 2",
    )
    recipe.execute(SimEnv(num_clients=n_clients))


if __name__ == "__main__":
    main()

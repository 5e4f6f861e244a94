"""An NVFlare FedProx job in the style of the cifar10-sim recipes: the training script's path is built from the job
file's place, and train_args hold a data path known only when the job runs (rankaudit reads it, never runs it)."""

import argparse
import os
import tempfile

from src.model import ModerateCNN

from nvflare.app_opt.pt.recipes.fedavg import FedAvgRecipe
from nvflare.recipe import SimEnv


def define_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n_clients", type=int, default=4)
    parser.add_argument("--num_rounds", type=int, default=6)
    parser.add_argument("--aggregation_epochs", type=int, default=2)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--fedproxloss_mu", type=float, default=1e-5)
    return parser.parse_args()


def main():
    args = define_parser()
    train_idx_root = os.path.join(tempfile.gettempdir(), f"cifar10_splits/alpha{args.alpha}")
    recipe = FedAvgRecipe(
        name=f"cifar10_fedprox_alpha{args.alpha}",
        min_clients=args.n_clients,
        num_rounds=args.num_rounds,
        model=ModerateCNN(),
        train_script=os.path.join(os.path.dirname(__file__), "src", "client.py"),
        train_args=f"--train_idx_root {train_idx_root} --lr {args.lr} --batch_size {args.batch_size} "
        f"--aggregation_epochs {args.aggregation_epochs} --fedproxloss_mu {args.fedproxloss_mu}",
    )
    recipe.execute(SimEnv(num_clients=args.n_clients))


if __name__ == "__main__":
    main()

"""An NVFlare job whose updates are encrypted (FedAvg with homomorphic encryption), for rankaudit's tests."""

from net import SmallNet

from nvflare.app_opt.pt.recipes.fedavg_he import FedAvgRecipeWithHE
from nvflare.recipe import PocEnv

N_CLIENTS = 3

recipe = FedAvgRecipeWithHE(
    name="he-job",
    min_clients=N_CLIENTS,
    num_rounds=4,
    model=SmallNet(),
    train_script="train.py",
    train_args="--batch_size 8 --epochs 3",
)
recipe.execute(PocEnv(num_clients=N_CLIENTS, use_he=True))

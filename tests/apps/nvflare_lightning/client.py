"""hello-lightning's client: a Lightning Trainer patched by NVFlare's client API (rankaudit never runs it)."""
import argparse

import nvflare.client.lightning as flare
from model import LitNet
from pytorch_lightning import LightningDataModule, Trainer
from torch.utils.data import DataLoader

BATCH_SIZE = 4


class CIFAR10DataModule(LightningDataModule):
    def __init__(self, data_dir: str = "/tmp/nvflare/data", batch_size: int = BATCH_SIZE):
        super().__init__()
        self.data_dir = data_dir
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.cifar_train, batch_size=self.batch_size)


def define_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--limit_batches", type=int, default=0)
    parser.add_argument("--synthetic_data", action="store_true")
    return parser.parse_args()


def main():
    args = define_parser()
    batch_size = args.batch_size
    flare.init()
    model = LitNet()
    cifar10_dm = CIFAR10DataModule(batch_size=batch_size)
    trainer = Trainer(max_epochs=1, devices=None)
    flare.patch(trainer)
    while flare.is_running():
        flare.receive()
        trainer.fit(model, datamodule=cifar10_dm)


if __name__ == "__main__":
    main()

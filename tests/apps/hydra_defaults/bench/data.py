"""Each client's loader over random images (the benchmark's data, small)."""

import torch
from torch.utils.data import DataLoader, TensorDataset


def load_loaders(dataset_cfg, num_clients):
    return [
        DataLoader(
            TensorDataset(torch.randn(64, 1, 8, 8), torch.randint(0, 5, (64,))),
            batch_size=dataset_cfg.batch_size,
            shuffle=True,
        )
        for _ in range(num_clients)
    ]

"""LeNet for label recovery (GDBR): examples/lenet.py's convs with ReLU, a LeNet-5 head and 10 classes."""

import torch.nn as nn

INPUT_SHAPE = (1, 28, 28)


class LeNet10(nn.Module):
    """ReLU because GDBR's theorems are about ReLU networks; the hidden Linear (588 -> 84) is the layer whose
    gradient GDBR reads, as the paper shares "the first or second FC layer in LeNet"."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 12, kernel_size=5, stride=2, padding=2, bias=False)
        self.conv2 = nn.Conv2d(12, 12, kernel_size=5, stride=2, padding=2, bias=False)
        self.conv3 = nn.Conv2d(12, 12, kernel_size=5, stride=1, padding=2, bias=False)
        self.act = nn.ReLU()
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(12 * 7 * 7, 84)
        self.fc2 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.act(self.conv1(x))
        x = self.act(self.conv2(x))
        x = self.act(self.conv3(x))
        return self.fc2(self.act(self.fc1(self.flatten(x))))

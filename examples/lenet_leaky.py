"""LeNet* of R-GAP Table 2: LeNet with LeakyReLU instead of Sigmoid."""

import torch.nn as nn

INPUT_SHAPE = (1, 28, 28)


class LeNetLeaky(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 12, kernel_size=5, stride=2, padding=2, bias=False)
        self.conv2 = nn.Conv2d(12, 12, kernel_size=5, stride=2, padding=2, bias=False)
        self.conv3 = nn.Conv2d(12, 12, kernel_size=5, stride=1, padding=2, bias=False)
        self.act = nn.LeakyReLU(0.2)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(12 * 7 * 7, 1, bias=False)

    def forward(self, x):
        x = self.act(self.conv1(x))
        x = self.act(self.conv2(x))
        x = self.act(self.conv3(x))
        return self.fc(self.flatten(x))

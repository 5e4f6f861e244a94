"""R-GAP Figure 2(d): two 3x3 convs; conv1's surplus becomes virtual constraints: RA-i -208 at conv2."""

import torch.nn as nn

INPUT_SHAPE = (3, 32, 32)


class Fig2D(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, kernel_size=3, bias=False)
        self.conv2 = nn.Conv2d(4, 4, kernel_size=3, bias=False)
        self.act = nn.LeakyReLU(0.2)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(4 * 28 * 28, 1, bias=False)

    def forward(self, x):
        x = self.act(self.conv1(x))
        x = self.act(self.conv2(x))
        return self.fc(self.flatten(x))

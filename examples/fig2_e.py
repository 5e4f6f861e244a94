"""R-GAP Figure 2(e): conv 5x5 then conv 4x4; the second conv is deficient: RA-i 316 at conv2."""

import torch.nn as nn

INPUT_SHAPE = (3, 32, 32)


class Fig2E(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, kernel_size=5, bias=False)
        self.conv2 = nn.Conv2d(4, 4, kernel_size=4, bias=False)
        self.act = nn.LeakyReLU(0.2)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(4 * 25 * 25, 1, bias=False)

    def forward(self, x):
        x = self.act(self.conv1(x))
        x = self.act(self.conv2(x))
        return self.fc(self.flatten(x))

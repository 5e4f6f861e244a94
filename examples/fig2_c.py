"""R-GAP Figure 2(c): Figure 2(b) with a wide hidden Linear; the conv stays critical: RA-i 405."""

import torch.nn as nn

INPUT_SHAPE = (3, 32, 32)


class Fig2C(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 3, kernel_size=4, bias=False)
        self.act = nn.LeakyReLU(0.2)
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(3 * 29 * 29, 500, bias=False)
        self.fc2 = nn.Linear(500, 1, bias=False)

    def forward(self, x):
        x = self.flatten(self.act(self.conv1(x)))
        return self.fc2(self.act(self.fc1(x)))

"""R-GAP Figure 2(b): conv 4x4 3->3, then a single-logit Linear. Rank-deficient: RA-i 405."""

import torch.nn as nn

INPUT_SHAPE = (3, 32, 32)


class Fig2B(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 3, kernel_size=4, bias=False)
        self.act = nn.LeakyReLU(0.2)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(3 * 29 * 29, 1, bias=False)

    def forward(self, x):
        return self.fc(self.flatten(self.act(self.conv1(x))))

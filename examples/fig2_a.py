"""R-GAP Figure 2(a): conv 4x4 3->4, then a single-logit Linear. Over-determined: RA-i -484."""

import torch.nn as nn

INPUT_SHAPE = (3, 32, 32)


class Fig2A(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, kernel_size=4, bias=False)
        self.act = nn.LeakyReLU(0.2)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(4 * 29 * 29, 1, bias=False)

    def forward(self, x):
        return self.fc(self.flatten(self.act(self.conv1(x))))

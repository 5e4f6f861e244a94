"""CNN6, the test network of R-GAP's official code: six convs, LeakyReLU(0.2), one logit."""

import torch.nn as nn

INPUT_SHAPE = (3, 32, 32)


class CNN6(nn.Module):
    """Spatial sizes 32 -> 17 -> 9 -> 9 -> 9 -> 5 -> 5; every conv without bias."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 12, kernel_size=4, stride=2, padding=2, bias=False)
        self.conv2 = nn.Conv2d(12, 36, kernel_size=3, stride=2, padding=1, bias=False)
        self.conv3 = nn.Conv2d(36, 36, kernel_size=3, stride=1, padding=1, bias=False)
        self.conv4 = nn.Conv2d(36, 36, kernel_size=3, stride=1, padding=1, bias=False)
        self.conv5 = nn.Conv2d(36, 64, kernel_size=3, stride=2, padding=1, bias=False)
        self.conv6 = nn.Conv2d(64, 128, kernel_size=3, stride=1, padding=1, bias=False)
        self.act = nn.LeakyReLU(0.2)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(128 * 5 * 5, 1, bias=False)

    def forward(self, x):
        for conv in (self.conv1, self.conv2, self.conv3, self.conv4, self.conv5, self.conv6):
            x = self.act(conv(x))
        return self.fc(self.flatten(x))

"""A small stand-in for DepthFL's multi-exit ResNet: n_blocks stages, a classifier."""
from torch import nn


class MultiNet(nn.Module):
    def __init__(self, n_blocks=4, num_classes=100):
        super().__init__()
        stages = [nn.Sequential(nn.Conv2d(3 if i == 0 else 4, 4, 3, padding=1), nn.ReLU()) for i in range(n_blocks)]
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(4 * 8 * 8, num_classes)

    def forward(self, x):
        return self.fc(self.stages(x).flatten(1))


def multi_resnet18(n_blocks=1, num_classes=100):
    return MultiNet(n_blocks=n_blocks, num_classes=num_classes)

"""factory_app: two models that need arguments."""
from torch import nn


class LogisticRegression(nn.Module):
    def __init__(self, num_features, num_classes):
        super().__init__()
        self.fc1 = nn.Linear(num_features, num_classes)

    def forward(self, x):
        return self.fc1(x)


def get_model(num_classes):
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, num_classes))

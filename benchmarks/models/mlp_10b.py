"""A ~10-billion-parameter MLP (10,002,812,500 parameters).

Benchmark model for rankaudit's memory behaviour. Its fp32 weights would take
~40 GB, so it must only ever be built on the ``meta`` device: never construct
it on a real device (and never run torchinfo on it).

Layout: flatten a 3x32x32 input (3072 features) -> Linear(3072, 49500) ->
4 x [ReLU, Linear(49500, 49500)] -> ReLU -> Linear(49500, 1000).
"""

from torch import nn

INPUT_SHAPE = (3, 32, 32)


class MLP10B(nn.Module):
    WIDTH = 49_500
    DEPTH = 4  # number of WIDTH x WIDTH hidden layers
    NUM_CLASSES = 1000

    def __init__(self):
        super().__init__()
        in_features = 1
        for d in INPUT_SHAPE:
            in_features *= d
        self.flatten = nn.Flatten(1)
        self.fc_in = nn.Linear(in_features, self.WIDTH)
        self.act_in = nn.ReLU()
        self.hidden = nn.Sequential()
        for i in range(self.DEPTH):
            self.hidden.add_module(f"fc{i}", nn.Linear(self.WIDTH, self.WIDTH))
            self.hidden.add_module(f"act{i}", nn.ReLU())
        self.head = nn.Linear(self.WIDTH, self.NUM_CLASSES)

    def forward(self, x):
        x = self.act_in(self.fc_in(self.flatten(x)))
        x = self.hidden(x)
        return self.head(x)

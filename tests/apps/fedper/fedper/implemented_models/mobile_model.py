"""A small MobileNet-like model whose last num_head_layers blocks form the head, its split and its manager."""
from torch import nn

from fedper.models import ModelManager, ModelSplit


def conv_dw(inp, oup, stride):
    return nn.Sequential(
        nn.Conv2d(inp, inp, 3, stride, 1, groups=inp, bias=False),
        nn.ReLU(),
        nn.Conv2d(inp, oup, 1, 1, 0, bias=False),
        nn.ReLU(),
    )


class MobileNet(nn.Module):
    def __init__(self, num_head_layers: int = 1, num_classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.ReLU(), conv_dw(8, 16, 1))
        if num_head_layers == 1:
            self.body.add_module("conv_dw_2", conv_dw(16, 16, 1))
            self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, num_classes))
        elif num_head_layers == 2:
            self.head = nn.Sequential(
                conv_dw(16, 16, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, num_classes)
            )
        else:
            raise NotImplementedError("Number of head layers not implemented.")

    def forward(self, x):
        return self.head(self.body(x))


class MobileNetModelSplit(ModelSplit):
    def _get_model_parts(self, model):
        return model.body, model.head


class MobileNetModelManager(ModelManager):
    def __init__(self, config, trainloader, learning_rate=0.01):
        super().__init__(config, trainloader, MobileNetModelSplit, learning_rate)

    def _create_model(self) -> nn.Module:
        return MobileNet(
            num_head_layers=self.config["model"]["num_head_layers"], num_classes=self.config["model"]["num_classes"]
        )

"""R-GAP Figure 4, variant 1: ResNet-18-w16 without the skip of block 3 (layer2.0); RA-i rises to about -7.8e3."""

from resnet18_w16 import ResNet18W16

INPUT_SHAPE = (3, 32, 32)


class ResNet18W16Cut3(ResNet18W16):
    def __init__(self):
        super().__init__(cut_skips=(3,))

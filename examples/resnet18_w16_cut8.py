"""R-GAP Figure 4, variant 2: ResNet-18-w16 without the skip of block 8 (layer4.1); RA-i does not change."""

from resnet18_w16 import ResNet18W16

INPUT_SHAPE = (3, 32, 32)


class ResNet18W16Cut8(ResNet18W16):
    def __init__(self):
        super().__init__(cut_skips=(8,))

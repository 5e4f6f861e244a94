"""rankaudit: predicts from a PyTorch architecture alone whether shared gradients reveal a client's input."""

__version__ = "0.1.0"

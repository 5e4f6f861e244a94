"""Flower's PyTorch quickstart with the rankaudit guard on every client."""

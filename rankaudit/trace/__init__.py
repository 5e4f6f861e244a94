"""The trace: the model's forward pass on meta tensors -> one record per call (no counting)."""

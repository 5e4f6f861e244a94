"""Loading the model: the model file -> nn.Module on the meta device, run in a supervised child process."""

"""Reading the deployment: a Flower app or an NVFlare job, read without running it, as a round, DP settings and a model spec."""

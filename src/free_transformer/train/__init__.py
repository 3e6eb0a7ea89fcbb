"""Training: the run configuration, the optimizer and schedule, and the training loop."""

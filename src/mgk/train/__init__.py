"""The training loop shared by every task, with checkpoints, DDP, precision and run records."""

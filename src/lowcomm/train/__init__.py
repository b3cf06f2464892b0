"""The training loop, metrics and the run directory."""

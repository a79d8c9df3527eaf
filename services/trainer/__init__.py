"""The trainer: policy and optimizer, GRPO steps, per-step checkpoints, weight publishing."""

"""GRPO training from the trajectory bus; checkpoints; weight pushes to inference."""

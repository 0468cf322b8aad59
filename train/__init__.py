"""Hydra-composed PyTorch DDP training with rank-0 MLflow tracking, locally or on Slurm."""

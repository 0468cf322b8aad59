"""Hydra-composed PyTorch DDP training with rank-0 MLflow tracking, locally or on Slurm."""

from train import _moved

_moved.install()  # module paths older pickles name (train/_moved.py); imports nothing heavy

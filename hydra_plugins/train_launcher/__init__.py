"""Hydra only instantiates launchers from the hydra_plugins namespace: this is ours."""

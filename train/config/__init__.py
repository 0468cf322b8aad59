"""The job's configuration: typed dataclasses (the only defaults), the Hydra schema, checks of
the values alone, and the user's code named by `_target_`. No torch, no mlflow."""

"""The job's configuration: typed dataclasses (the only defaults), the Hydra schema, checks of
the values alone, and the user's code named by `_target_`. No torch, no mlflow."""


def __getattr__(name: str) -> object:  # a name of the old module this wing replaced
    from train._moved import old_name

    return old_name(__name__, name)

"""Where a rank sits and how ranks talk: the launch environment, the process group, devices,
stop signals, and what a rank does inside a Slurm job (requeue, tags)."""


def __getattr__(name: str) -> object:  # a name of the old module this wing replaced
    from train._moved import old_name

    return old_name(__name__, name)

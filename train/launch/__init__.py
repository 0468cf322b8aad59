"""Starting jobs: pre-flight checks, local ranks, the job lock, Slurm submission and following
(login-node side)."""


def __getattr__(name: str) -> object:  # a name of the old module this wing replaced
    from train._moved import old_name

    return old_name(__name__, name)

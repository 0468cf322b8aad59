"""Starting jobs: pre-flight checks, local ranks, the job lock, Slurm submission (with its code
snapshot) and following (login-node side); rerunning a recorded run with its own code, and
comparing two runs."""


def __getattr__(name: str) -> object:  # a name of the old module this wing replaced
    from train._moved import old_name

    return old_name(__name__, name)

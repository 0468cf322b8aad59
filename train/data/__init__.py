"""Data: built-in sets held in memory, files streamed from disk, the user's Datasets; the split,
each rank's share, the DataLoader, and a description of the data (no MLflow: tracking records
it)."""


def __getattr__(name: str) -> object:  # a name of the old module this wing replaced
    from train._moved import old_name

    return old_name(__name__, name)

"""Models: built-in, torchvision and the user's, pretrained weights, freezing and parameter
groups, and whether torch.export can trace one."""


def __getattr__(name: str) -> object:  # a name of the old module this wing replaced
    from train._moved import old_name

    return old_name(__name__, name)

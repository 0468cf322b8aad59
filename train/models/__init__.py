"""Models: built-in, torchvision and the user's, pretrained weights, freezing and parameter
groups, and whether torch.export can trace one."""

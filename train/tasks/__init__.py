"""Tasks: how a model's output and a batch's target become a loss and exact metrics
(classification, regression, segmentation, or the user's own: task=custom). Beside the engine,
which runs any of them alike; train/tasks/base.py says what a task implements."""

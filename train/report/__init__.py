"""What a run records and prints, apart from MLflow itself: params and tags, progress, metrics
as exact sums, figures, FLOPs, the model card, the code the run ran. Sends through the
tracking wing's backend."""

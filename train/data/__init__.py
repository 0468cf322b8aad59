"""Data: built-in sets held in memory, files streamed from disk, the user's Datasets; the split,
each rank's share, the DataLoader, and a description of the data (no MLflow: tracking records it)."""

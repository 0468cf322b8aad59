"""Training one rank: the job script, the loop, its state, checkpoints, the monitor, the
optimiser."""

"""Where a rank sits and how ranks talk: the launch environment, the process group, devices,
stop signals, and what a rank does inside a Slurm job (requeue, tags)."""

"""Starting jobs: pre-flight checks, local ranks, the job lock, Slurm submission and following
(login-node side)."""

"""Runs of an experiment as jobs: local processes or SLURM (docs/cluster.md)."""

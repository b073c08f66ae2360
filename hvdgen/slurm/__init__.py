"""Slurm batch scripts for a project: `slurm/train.sbatch` and the `hvdgen slurm` command."""

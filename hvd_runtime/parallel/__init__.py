"""Framework-free layouts of ranks for the parallel strategies (no Horovod, no framework)."""

"""Framework-free layouts of ranks for the parallel strategies: pure arithmetic, and Horovod only
to name the global process set."""

"""What every parallel layout asks of the world, whichever strategy: its size before Horovod starts,
whether a factor divides it, and which Horovod process set a group of its ranks uses."""

from __future__ import annotations

import os

# How each launcher tells a rank the world size: horovodrun with Gloo, OpenMPI's mpirun (horovodrun
# with MPI), MPICH and Intel MPI. A layout's process sets go to hvd.init, so the size is needed first.
WORLD_SIZE_VARIABLES = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def launched_world_size() -> int | None:
    """The world size this process was launched into, before Horovod starts; None if started alone."""
    for name in WORLD_SIZE_VARIABLES:
        if os.environ.get(name):
            return int(os.environ[name])
    return None


def check_factor(world: int, factor, name: str, option: str, error: type[Exception]) -> None:
    """Raise `error` with one line naming -np and the factor unless `factor` divides `world`.

    name: how the layout calls the factor ("stages", "tp"); option: how the user sets it.
    """
    if not isinstance(factor, int) or factor < 1:
        raise error(f"{name} must be a positive integer, got {factor!r} (e.g. 2)")
    if world % factor:
        raise error(f"world size {world} (horovodrun -np) is not {name} {factor} x replicas: "
                    f"use -np {factor}, {2 * factor}, {3 * factor}... or a {option} that divides {world}")


def process_set_of(ranks, world: int, sets: dict):
    """The Horovod process set of `ranks`: the global set for the whole world, else the one made
    for exactly these ranks at hvd.init (`sets`, keyed by the ranks as a tuple)."""
    from horovod.common.process_sets import global_process_set

    return global_process_set if len(ranks) == world else sets[tuple(ranks)]

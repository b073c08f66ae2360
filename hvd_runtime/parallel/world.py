"""What every parallel layout asks of the world, whichever strategy: its size before Horovod starts,
and which Horovod process set a group of its ranks uses."""

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


def grid_of(hvd, world: int, tp: int = 1, pp: int = 1):
    """The ParallelDims of this launch, or its one-line refusal raised on every rank together.

    The grid must be known before hvd.init (it lists the process sets), so a bad one is found while
    each rank runs on its own clock; horovodrun stops the others the moment one exits, and a rank
    still starting would never print the line. So every rank first meets in hvd.init and one
    collective, then all raise. `hvd`: horovod.torch or horovod.tensorflow.
    """
    from hvd_runtime.parallel.dims import ParallelConfigError, ParallelDims

    try:
        return ParallelDims(world=world, tp=tp, pp=pp)
    except ParallelConfigError:
        if not hvd.is_initialized():
            hvd.init()
        hvd.allgather_object(None, name="grid.refusal")
        raise


def process_set_of(ranks, world: int, sets: dict):
    """The Horovod process set of `ranks`: the global set for the whole world, None for a rank
    alone (nothing to exchange), else the one made for exactly these ranks at hvd.init (`sets`,
    keyed by the ranks as a tuple)."""
    from horovod.common.process_sets import global_process_set

    if len(ranks) == world:
        return global_process_set
    return None if len(ranks) == 1 else sets[tuple(ranks)]

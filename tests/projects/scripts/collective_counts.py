"""Every element a Horovod collective hands back, counted while a block runs: count_held_elements' and count_held_variables'.

Horovod allocates a collective's output on its own thread, out of sight of whatever counts a
rank's own allocations: what every collective returns is counted instead (object collectives:
the tensors inside the objects), by the framework's `received(output) -> elements`.
"""

import contextlib

COLLECTIVES = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "grouped_allreduce",
               "grouped_allgather", "grouped_reducescatter", "synchronize", "allgather_object", "broadcast_object",
               "broadcast_variables")


@contextlib.contextmanager
def counting_collectives(hvd, counting, received):
    """Inside, each of hvd's collectives (those it has) adds received(output) to counting.elements."""
    originals = {name: getattr(hvd, name) for name in COLLECTIVES if hasattr(hvd, name)}

    def wrap(call):
        def counted_call(*args, **kwargs):
            out = call(*args, **kwargs)
            counting.elements += received(out)
            return out
        return counted_call

    for name, call in originals.items():
        setattr(hvd, name, wrap(call))
    try:
        yield counting
    finally:
        for name, call in originals.items():
            setattr(hvd, name, call)

"""Who this process is in the job, for either framework: read from Horovod each time it is asked.

An elastic job renumbers its ranks after a reset, so rank and size are never cached. Each
framework's Context names its Horovod module (horovod.torch or horovod.tensorflow), imported on
first use so that importing the context stays cheap.
"""

from __future__ import annotations

import importlib
from typing import ClassVar


class RankContext:
    """rank, size, local_rank, local_size and is_root of this process, live; and which data-parallel
    replica it is (`data_rank` of `data_size`), which differs from its rank under tensor or
    pipeline parallelism, where a group of ranks (a tp group, a replica's stages) shares each batch."""

    horovod_module: ClassVar[str]
    tensor: object = None    # hvd_runtime.parallel.tensor_groups.TensorRanks under tensor parallelism
    pipeline: object = None  # hvd_runtime.pipeline.grid.PipelineRank: this rank's stage and replica

    @property
    def _grid(self):
        """This rank's place in a grid of ranks (both kinds hold the ParallelDims and the dp set), or None."""
        return self.pipeline if self.pipeline is not None else self.tensor

    def _hvd(self):
        return importlib.import_module(self.horovod_module)

    @property
    def rank(self) -> int:
        return self._hvd().rank()

    @property
    def size(self) -> int:
        return self._hvd().size()

    @property
    def local_rank(self) -> int:
        return self._hvd().local_rank()

    @property
    def local_size(self) -> int:
        return self._hvd().local_size()

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """Which shard of each batch this rank reads: its data-parallel replica."""
        return self.rank if self._grid is None else self._grid.dims.coords(self.rank).dp

    @property
    def data_size(self) -> int:
        """How many replicas average gradients: what sharding and LR scaling count."""
        return self.size if self._grid is None else self._grid.dims.dp

    def from_root(self, value):
        """Rank 0's `value`, on every rank (a broadcast: every rank calls). For what only rank 0 can
        decide, such as whether this epoch's checkpoint becomes an MLflow model, before a collective
        that only that makes worth its cost."""
        return self._hvd().broadcast_object(value, root_rank=0, name="rank_context.from_root")

    @property
    def coords(self):
        """This rank's (dp, pp, tp) in the grid of a tensor-parallel or pipeline job; None without one."""
        return None if self._grid is None else self._grid.dims.coords(self.rank)

    @property
    def dp_set(self):
        """The Horovod process set gradients are averaged in; None when this rank is the only replica."""
        return self._hvd().global_process_set if self._grid is None else self._grid.dp_set


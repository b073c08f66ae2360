"""Who this process is in the job, for either framework: read from Horovod each time it is asked.

An elastic job renumbers its ranks after a reset, so rank and size are never cached. Each
framework's Context names its Horovod module (horovod.torch or horovod.tensorflow), imported on
first use so that importing the context stays cheap.
"""

from __future__ import annotations

import importlib
from typing import ClassVar


class RankContext:
    """rank, size, local_rank, local_size and is_root of this process, live."""

    horovod_module: ClassVar[str]

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


"""The garbage collector paused while a framework loads.

Every rank on a host imports torch or TensorFlow, Keras and Horovod at the same moment, and those
imports create hundreds of thousands of objects. With the collector on, it walks them again and
again as they pile up (hundreds of collections a rank) for nothing: they live as long as the
process. `hvd_runtime.torch` and `hvd_runtime.tf` import under `collector_paused()`, which then
freezes what was made (`gc.freeze`), so later collections skip it. docs/architecture.md gives
what it saves.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Collect nothing inside; on leaving, freeze what exists and collect as before. A caller that
    had the collector off keeps it off, and nothing is frozen for it."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()

"""A CPU rank keeps the memory it frees for its next step, instead of handing it back to the kernel.

A training step allocates and frees the same tensors every step: activations, their gradients,
messages between pipeline stages. glibc's malloc hands freed memory back to the kernel once the
free space at the top of its heap passes a threshold (128 KiB at first, raised up to 64 MiB as
larger blocks come and go), and serves blocks above another threshold (128 KiB to 32 MiB,
likewise) with a fresh mmap each time. Either way the next step touches new pages, and every
4 KiB page costs a fault: on a CPU that is a large part of a small model's step
(docs/horovod-on-cpu.md has the measurements, for our loop and torch DDP alike).

So a PyTorch CPU rank sets glibc's trim threshold to its largest value and its mmap threshold to
32 MiB, the largest below which blocks come from the heap. The cost: a rank's resident memory
stays at its high-water mark, which training reaches every step anyway. GPU ranks keep glibc's
defaults (their tensors live in the device's caching allocator), and so do TensorFlow ranks,
which ran no faster with it (docs/horovod-on-cpu.md).

A user's own malloc settings win: with `MALLOC_TRIM_THRESHOLD_`, `MALLOC_MMAP_THRESHOLD_`,
`MALLOC_TOP_PAD_` or a `glibc.malloc` tunable in `GLIBC_TUNABLES` in the environment (or another
allocator preloaded, e.g. jemalloc or tcmalloc, which glibc's settings do not reach), nothing is
changed. Not glibc (macOS, musl): nothing to do.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1     # glibc's malloc.h
M_MMAP_THRESHOLD = -3
KEPT_BYTES = 2**31 - 1    # mallopt takes an int: free memory is kept up to 2 GiB at the heap's top
HEAP_BLOCK_LIMIT = 32 * 2**20   # glibc's largest mmap threshold on 64-bit hosts
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")


def user_chose_allocator(environ=os.environ) -> bool:
    """The environment already sets glibc's malloc, or preloads another allocator."""
    return (any(k in environ for k in USER_SETTINGS) or "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")
            or "malloc" in environ.get("LD_PRELOAD", ""))


def keep_freed_memory(environ=os.environ) -> bool:
    """Set glibc's thresholds as the module docstring says; True when they were set."""
    if user_chose_allocator(environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):   # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the mmap threshold first: setting either one stops glibc adjusting both
    return bool(mallopt(M_MMAP_THRESHOLD, HEAP_BLOCK_LIMIT)) and bool(mallopt(M_TRIM_THRESHOLD, KEPT_BYTES))

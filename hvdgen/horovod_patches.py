"""The fixes hvdgen applies to the horovod 0.28.1 sdist before building it.

Horovod's last release predates current compilers, PyTorch, TensorFlow and Keras 3, and upstream
carries the fixes only as open pull requests. Each patch is a literal text replacement whose `old`
text must be present, so a changed sdist fails loudly instead of building something unpatched.
The wheel cache key includes `patches_digest()`, so changing a patch never reuses an old wheel.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Patch:
    """A textual fix to the sdist. `old` must be present, so a changed sdist fails loudly."""

    path: str
    old: str
    new: str
    why: str


PATCHES = (
    Patch("CMakeLists.txt", "set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)",
          "torch >= 2.1 headers need C++17; changing only the torch subdir breaks Gloo at link time"),
    Patch("horovod/torch/CMakeLists.txt", "set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)",
          "torch >= 2.1 headers need C++17 (fixed on Horovod master, #3998)"),
    Patch("horovod/tensorflow/CMakeLists.txt",
          'list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")\n', "",
          "optional XLA ops include xla_builder.h, which moved in TF >= 2.19"),
)


def patches_digest() -> str:
    """A short fingerprint of every patch: part of the wheel cache key."""
    text = "\0".join(f"{p.path}\0{p.old}\0{p.new}" for p in PATCHES)
    return hashlib.sha256(text.encode()).hexdigest()[:8]

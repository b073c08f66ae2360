"""What the installed Horovod was built with, and whether it fits the frameworks beside it: the
build checks `hvdgen doctor` reports and `hvdgen install-horovod`'s tests read.

A Horovod whose GPU ops do not fit the torch beside it (a CUDA torch but no NCCL ops, NCCL ops but
a CPU torch) still runs, so that is a warning, not a problem.
"""

from __future__ import annotations

import re

from hvdgen.build.cuda import GpuBuildBlocked, find_gpu_build
from hvdgen.build.horovod_wheel import NCCL_WITH_TENSORFLOW


def parse_check_build(text: str) -> dict[str, dict[str, bool]]:
    """Turn `horovodrun --check-build` output into {section: {item: enabled}}."""
    sections: dict[str, dict[str, bool]] = {}
    current = None
    for line in text.splitlines():
        heading = re.match(r"Available (.+):\s*$", line.strip())
        item = re.match(r"\s*\[(X| )\]\s+(.+?)\s*$", line)
        if heading:
            current = sections.setdefault(heading.group(1), {})
        elif item and current is not None:
            current[item.group(2)] = item.group(1) == "X"
    return sections


def gpu_toolchain(cuda: str, tensorflow: str | None) -> str:
    """What a rebuild with NCCL ops would compile against, or why there can be none."""
    if tensorflow:
        return f"none beside TensorFlow: {NCCL_WITH_TENSORFLOW}"
    try:
        gpu = find_gpu_build(cuda)
    except GpuBuildBlocked as blocked:
        return f"not usable: {blocked}"
    return (f"CUDA {gpu.toolkit.version} at {gpu.toolkit.root} (found through {gpu.toolkit.found_by}); "
            f"NCCL {gpu.nccl.version} ({gpu.nccl.found_by})")


def build_mismatches(torch_cuda: str | None, tensor_ops: dict[str, bool], tensorflow: str | None = None) -> list[str]:
    """Warnings for a Horovod whose GPU ops do not fit the installed torch (CPU or CUDA build)."""
    nccl = tensor_ops.get("NCCL", False)
    if torch_cuda and not nccl:
        way = ("NCCL ops need a venv without TensorFlow (see gpu build above)" if tensorflow
               else "hvdgen install-horovod builds (or reinstalls) one with NCCL")
        return [f"torch is a CUDA {torch_cuda} build but horovod has no NCCL ops, so GPU tensors are reduced "
                f"through host memory: {way}"]
    if nccl and not torch_cuda:
        return ["horovod has NCCL ops but torch is a CPU build: hvdgen install-horovod builds one for this torch"]
    return []

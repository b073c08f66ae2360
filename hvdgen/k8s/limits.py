"""Sane bounds for what a job asks of the cluster, and the Kubernetes quantities they are written in.

The bounds are the same for the options of `hvdgen k8s` and for `hvdgen k8s --check`, so a
manifest hvdgen writes never fails its own check. They reject typos (`--workers 100000`, `cpu:
40000`), not large jobs: each is above what any single node or common cluster offers today.
"""

from __future__ import annotations

import re
from decimal import Decimal

MAX_WORKERS = 1024  # worker pods in one MPIJob
MAX_GPUS_PER_POD = 64  # no node holds more than 16 GPUs; 64 leaves room for time-sliced GPUs
MAX_CPU = Decimal(1024)  # cores per container; the largest machines have 448-896 hardware threads
MAX_MEMORY = Decimal(32 * 2**40)  # 32Ti per container; the largest machines have 24 TiB
MAX_EPHEMERAL = Decimal(64 * 2**40)  # 64Ti of node-local disk per container
MIN_CLAIM = Decimal(2**30)  # 1Gi: the smallest volume common provisioners (EBS, Azure Disk) grant
MAX_CLAIM = Decimal(64 * 2**40)  # 64Ti: the largest single volume of EBS and GCE persistent disks

# Container resources hvdgen bounds: name -> (largest value, how to write it).
RESOURCE_BOUNDS = {"cpu": (MAX_CPU, "1024"), "memory": (MAX_MEMORY, "32Ti"),
                   "ephemeral-storage": (MAX_EPHEMERAL, "64Ti")}

# The Kubernetes quantity grammar (k8s.io/apimachinery resource.Quantity), as the CRD's pattern.
_QUANTITY = re.compile(r"([+-]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?")
_SUFFIX = {"": 1, "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
           "k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12),
           "P": Decimal(10**15), "E": Decimal(10**18),
           "Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30), "Ti": Decimal(2**40),
           "Pi": Decimal(2**50), "Ei": Decimal(2**60)}


def parse_quantity(value) -> Decimal | None:
    """`500m` -> 0.5, `4Gi` -> 4294967296, `2` -> 2; None for anything that is not a quantity."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return Decimal(str(value))
    match = _QUANTITY.fullmatch(value) if isinstance(value, str) else None
    if not match:
        return None
    sign, number, suffix = match.groups()
    suffix = suffix or ""
    try:
        scale = Decimal(10) ** int(suffix[1:]) if suffix[:1] in ("e", "E") else _SUFFIX[suffix]
        amount = Decimal(number) * scale
    except ArithmeticError:  # an exponent beyond what Decimal holds
        return None
    return -amount if sign == "-" else amount


def is_gpu(resource) -> bool:
    """`nvidia.com/gpu`, `amd.com/gpu`: the extended resources the device plugins advertise."""
    return isinstance(resource, str) and resource.endswith("/gpu")

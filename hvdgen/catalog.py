"""Which frameworks and strategies exist, and which of their combinations hvdgen can generate."""

from __future__ import annotations

FRAMEWORKS = ("torch", "tensorflow")
STRATEGIES = ("data", "model-split", "pipeline")

# The framework release each generated project pins: the one this hvdgen release is tested with.
# scripts/setup.sh installs the same (a test keeps the two in step).
FRAMEWORK_PINS = {"torch": "torch==2.13.0", "tensorflow": "tensorflow==2.21.0"}

# (framework, strategy) -> one line on what the generated project does.
AVAILABLE = {
    ("torch", "data"): "Horovod DistributedOptimizer, ring-allreduce of gradients",
    ("tensorflow", "data"): "Keras 3 custom loop, one grouped allreduce of gradients per step",
    ("torch", "model-split"): "stages on one worker's devices, micro-batched; Horovod data parallel across workers",
    ("torch", "pipeline"): "stages on ranks, GPipe or 1F1B micro-batches; stages x replicas with process sets",
    ("tensorflow", "model-split"): "stages on one worker's devices (GPUs or logical CPUs); Horovod DP across workers",
    ("tensorflow", "pipeline"): "stages on ranks, a GradientTape per micro-batch, GPipe or 1F1B; stages x replicas",
}


def is_available(framework: str, strategy: str) -> bool:
    return (framework, strategy) in AVAILABLE


def rows() -> list[tuple[str, str, bool, str]]:
    """Every framework x strategy, available or not, for `hvdgen list`."""
    return [(f, s, is_available(f, s), AVAILABLE.get((f, s), "not yet available"))
            for f in FRAMEWORKS for s in STRATEGIES]

"""Which frameworks and strategies exist, and which of their combinations hvdgen can generate."""

from __future__ import annotations

from dataclasses import dataclass, replace

# stdlib only, like this module: `hvdgen doctor` imports the CLI with nothing but click installed
from hvd_runtime.pipeline.schedule import SCHEDULES as _RUNTIME_SCHEDULES, SPLIT_BACKWARD

FRAMEWORKS = ("torch", "tensorflow")
STRATEGIES = ("data", "model-split", "pipeline", "tensor")
SCHEDULES = tuple(_RUNTIME_SCHEDULES)     # pipeline schedules, as the runtime names them
CONFLICT_STYLES = ("inline", "rej")       # hvdgen update: clashing lines marked in the file, or beside it in .rej


def schedules(framework: str) -> tuple[str, ...]:
    """The schedules a project of `framework` can use: TensorFlow has no split backward (zb-h1, 1f1b-batched-w)."""
    return tuple(s for s in SCHEDULES if framework == "torch" or s not in SPLIT_BACKWARD)


@dataclass(frozen=True)
class Model:
    """A model a project can start from: model.py, data.py and config.yaml follow the choice."""

    what: str
    blocks: int             # blocks at the generated config: the most stages it can be cut into
    block_names: str        # what those blocks are, for a refusal
    more_blocks: str        # how a user gets more of them
    heads: int = 0          # attention heads at the generated config: what tensor parallelism splits (0: none)


MODELS = {
    "mlp": Model("a small multi-layer perceptron on 8x8 digits (fast; the default)", 4,
                 "flatten, 2 hidden layers, head", "add hidden layers (config.yaml model.hidden)"),
    "resnet18": Model("ResNet-18 for small images (digits by default, or your image folder streamed from disk)", 10,
                      "stem, 8 residual blocks, head", "split inside a block in model.py"),
    "gpt": Model("a GPT-style decoder-only language model over a token file read through memmap", 6,
                 "embedding, 4 transformer layers, head", "add transformer layers (config.yaml model.layers)", heads=4),
}



@dataclass(frozen=True)
class GptSize:
    """A GPT's shape as config.yaml starts it (`hvdgen new --model gpt --size NAME`)."""

    what: str
    layers: int
    heads: int
    width: int
    context: int
    batch_size: int   # per rank
    lr: float         # for one rank (AdamW)
    precision: str    # train.precision


GPT_SIZES = {
    "tiny": GptSize("4 layers of width 64, context 64: trains in minutes on a CPU (the default)",
                    4, 4, 64, 64, 32, 1e-3, "fp32"),
    "gpt2-small": GptSize("GPT-2 small: 12 layers, 12 heads, width 768, context 1024 (124 M parameters with "
                          "GPT-2's vocabulary); a GPU's size", 12, 12, 768, 1024, 16, 6e-4, "bf16"),
}
DEFAULT_SIZE = "tiny"


def model_at(name: str, size: str = DEFAULT_SIZE) -> Model:
    """MODELS[name] with the blocks and heads of `size` (a GPT's; the other models have one size)."""
    model = MODELS[name]
    if name != "gpt":
        return model
    shape = GPT_SIZES[size]
    return replace(model, blocks=shape.layers + 2, block_names=f"embedding, {shape.layers} transformer layers, head",
                   heads=shape.heads)


# The framework release each generated project pins: the one this hvdgen release is tested with.
# scripts/setup.sh installs the same (a test keeps the two in step).
FRAMEWORK_PINS = {"torch": "torch==2.13.0", "tensorflow": "tensorflow==2.21.0"}

# (framework, strategy) -> one line on what the generated project does; a pipeline's names the schedules
# a project of that framework can use (schedules() above), so the line cannot fall behind the runtime.
AVAILABLE = {
    ("torch", "data"): "Horovod DistributedOptimizer, ring-allreduce of gradients",
    ("tensorflow", "data"): "Keras 3 custom loop, one grouped allreduce of gradients per step",
    ("torch", "model-split"): "stages on one worker's devices, micro-batched; Horovod data parallel across workers",
    ("torch", "pipeline"): f"stages on ranks ({', '.join(schedules('torch'))}); stages x replicas; --tp N splits stages",
    ("tensorflow", "model-split"): "stages on one worker's devices (GPUs or logical CPUs); Horovod DP across workers",
    ("tensorflow", "pipeline"): f"stages on ranks, a tape per micro-batch ({', '.join(schedules('tensorflow'))}); "
                                "--tp N splits stages (gpt)",
    ("torch", "tensor"): "attention heads and MLP split over a tp group (Megatron-style, gpt); tp x replicas",
    ("tensorflow", "tensor"): "attention heads and MLP split over a tp group (Megatron-style, gpt); tp x replicas",
}


def is_available(framework: str, strategy: str) -> bool:
    return (framework, strategy) in AVAILABLE


def splits(strategy: str, model: str) -> bool:
    """Whether `strategy` can split `model`: tensor parallelism splits attention heads and MLPs."""
    return strategy != "tensor" or MODELS[model].heads > 0


def default_model(strategy: str) -> str:
    """The model a project of `strategy` starts from unless --model says otherwise."""
    return next(name for name in MODELS if splits(strategy, name))


def shapes() -> list[tuple[str, str, str]]:
    """Every (framework, strategy, model) hvdgen new generates."""
    return [(f, s, m) for f, s in sorted(AVAILABLE) for m in MODELS if splits(s, m)]


def rows() -> list[tuple[str, str, bool, str]]:
    """Every framework x strategy, available or not, for `hvdgen list`."""
    return [(f, s, is_available(f, s), AVAILABLE.get((f, s), "not yet available"))
            for f in FRAMEWORKS for s in STRATEGIES]


def model_rows() -> list[tuple[str, str]]:
    """Every model and what it is: each generates for every available framework x strategy that splits it."""
    return [(name, model.what) for name, model in MODELS.items()]

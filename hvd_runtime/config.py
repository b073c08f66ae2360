"""The run config: typed dataclass sections, read from YAML, overridden from the command line.

Precedence: command line > config file > dataclass default. Overrides are `--section.key value`
or `section.key=value`; values are parsed as YAML and checked against the field's type, so a
typo in a key or a wrong type stops the run at start-up with one line naming the key.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from hvd_runtime.errors import UserError, launch_rank
from hvd_runtime.nonfinite import POLICIES as NONFINITE_POLICIES


class ConfigError(UserError, ValueError):
    """A bad key or value in the config file or an override."""

    kind = "config error"


@dataclass
class DataConfig:
    source: str = "digits"          # digits | npz | image_folder | tokens | synthetic
    path: str = ""                  # .npz file, image folder or token folder, for those sources
    val_fraction: float = 0.2       # held out from the training set when the source has no split
    image_size: int = 32            # image_folder: images are resized to image_size x image_size
    synthetic_samples: int = 4096   # synthetic: samples, features and classes
    synthetic_features: int = 64
    synthetic_classes: int = 10
    workers: int = 2                # image_folder, tokens: processes per rank reading batches (0 = the rank itself)


@dataclass
class ModelConfig:
    """The generated model.py reads the keys of its own model: mlp, resnet18 or gpt."""

    hidden: list[int] = field(default_factory=lambda: [128, 64])  # mlp: widths of the hidden layers
    dropout: float = 0.0            # mlp, gpt
    batch_norm: bool = False        # mlp: BatchNorm after each hidden layer (see horovod.sync_batchnorm)
    width: int = 64                 # resnet18: channels of its first stage; gpt: embedding width
    layers: int = 4                 # gpt: transformer blocks
    heads: int = 4                  # gpt: attention heads (width must divide by it)
    context: int = 128              # gpt: tokens per training window
    vocab_multiple: int = 1         # gpt: the vocabulary padded to a multiple of this (ids past the data's never occur)
    tie_embeddings: bool = True     # gpt: the output head shares the token embedding
    recompute: str = "none"         # none | blocks: each block runs its forward again in backward, keeping
                                    # only its input (activation memory for a forward's compute)


@dataclass
class TrainConfig:
    epochs: int = 20
    batch_size: int = 32            # per rank; the global batch is batch_size x world size
    eval_batch_size: int = 256
    log_every: int = 10             # steps between averaged train-loss and throughput points; 0 = off
    precision: str = "fp32"         # fp32 | bf16 | fp16 (fp16 needs a GPU: its gradients are loss-scaled)
    hang_timeout_s: float = 300.0   # a step not done in this time ends the rank, stacks dumped (watchdog); 0 = off
    hang_allowance_s: float = 1800.0   # the same for start-up, first steps, evaluations, checkpoints
    grace_s: float = 30.0           # after SIGTERM / SIGUSR1: the time to stop at a step, checkpoint and exit
    compile: str = "auto"           # auto | on | off: torch.compile of the model (auto: on GPUs)
    on_nonfinite: str = "skip"      # skip | stop | off: an update whose loss or gradients are NaN or inf
    max_skipped: int = 5            # skip: this many non-finite updates in a row are skipped, the next stops the run


@dataclass
class OptimConfig:
    name: str = "sgd"               # sgd | adam | adamw
    lr: float = 0.05                # for one rank; scaled by world size when scale_lr is true
    momentum: float = 0.9
    weight_decay: float = 0.0
    scale_lr: bool = True           # lr x world size (Goyal et al.), since the global batch grows with it
    warmup_epochs: float = 2.0      # linear ramp from lr to the scaled lr, then constant
    clip_norm: float = 0.0          # clip gradients to this global norm after the allreduce; 0 = off


@dataclass
class HorovodConfig:
    fp16_compression: bool = False  # halve allreduce traffic by sending gradients as fp16
    backward_passes_per_step: int = 1   # local gradient accumulation before one allreduce
    adasum: bool = False            # Adasum instead of averaging (scales lr by local size, not world size)
    sync_batchnorm: bool = False    # BatchNorm statistics over the global batch, not the local one
    threads_per_rank: int = 0       # CPU threads per rank; 0 = cores / local ranks
    cycle_time_ms: float = 0.0      # Horovod background-loop period; 0 = by device (scaling.set_cycle_time)
    elastic_commit_every: int = 20  # elastic jobs: steps between commits (what a lost worker rolls back to)
    zero: int = 0                   # shard over the replicas: 1 optimizer state, 2 also gradients, 3 also parameters


@dataclass
class ParallelConfig:
    """model-split, pipeline and tensor only: how the model is cut into stages, or its layers split."""

    stages: int = 2                 # model-split: devices per worker; pipeline: ranks per replica (-np = stages x replicas)
    micro_batches: int = 4          # each batch is cut into this many (a smaller batch: one per sample)
    schedule: str = "1f1b"          # pipeline: gpipe | 1f1b | zb-h1 (torch: a third of 1f1b's bubble, same memory)
    #                                 | interleaved-1f1b (1f1b's bubble / chunks; micro_batches a multiple of stages)
    #                                 | 1f1b-batched-w (torch: weight gradients in batches)
    chunks: int = 2                 # interleaved-1f1b: the model's chunks per rank (Megatron's virtual stages)
    partition: str = "time"         # time | params | block names or indices where stages 2.. start, e.g. "3" or "2,4"
    tp: int = 1                     # tensor: ranks per tensor-parallel group (-np = tp x replicas)


@dataclass
class CheckpointConfig:
    dir: str = "checkpoints"        # a folder per checkpoint, a shard per rank holding a part of the model; the newest is resumed
    keep: int = 3                   # how many recent checkpoints to keep
    every_steps: int = 0            # also checkpoint every N steps within an epoch; 0 = once per epoch
    resume: bool = True
    max_failures: int = 2           # failed writes in a row (a full disk) the run goes on past; the next, or the last, stops it


@dataclass
class TrackingConfig:
    enabled: bool = True            # MLflow on rank 0; never a reason for training to fail
    uri: str = ""                   # server URI; MLFLOW_TRACKING_URI wins; "" and no env = sqlite:///mlflow.db
    experiment: str = ""            # "" = the project name
    system_metrics: bool = True     # each host's CPU, memory, disk, network, GPUs: system/<host>/... per epoch
    checkpoint_models: str = "auto"  # epochs' checkpoints as MLflow models: auto | every | final (tracking.tracker)


@dataclass
class RunConfig:
    seed: int = 42
    run_dir: str = "runs/latest"    # metrics.jsonl and the resolved config, rank 0 only
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    horovod: HorovodConfig = field(default_factory=HorovodConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _check_type(key: str, value, annotation):
    """Coerce ints to floats where a float is wanted, and to text where text is wanted (YAML and the
    command line read `--parallel.partition 3` as the number 3), and a number YAML left as text
    (`3e-4`) to a float; reject anything else of the wrong type."""
    origin = typing.get_origin(annotation)
    if annotation in (float, str) and isinstance(value, int) and not isinstance(value, bool):
        return annotation(value)
    if annotation is float and isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
        return float(value)   # YAML 1.1 reads 3e-4 (no dot) as text
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list of {item_type.__name__}, got {value!r}")
        return [_check_type(f"{key}[{i}]", v, item_type) for i, v in enumerate(value)]
    expected = annotation if isinstance(annotation, type) else object
    if expected is str and isinstance(value, bool):   # `off`, `no`, `yes`, `on` in YAML or on the command line
        if ("on" if value else "off") in CHOICES.get(key, ()):   # a choice named off (or on): the word meant
            return "on" if value else "off"
        fix = f"choose one of {', '.join(CHOICES[key])}" if key in CHOICES else "quote the value"
        raise ConfigError(f"{key} must be str, got {value!r} (YAML reads on, off, yes, no as true or false): {fix}")
    if expected is int and isinstance(value, bool) or not isinstance(value, expected):
        raise ConfigError(f"{key} must be {expected.__name__}, got {value!r}")
    return value


def _build(cls, data: dict, prefix: str = ""):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown config key {prefix}{unknown[0]}: valid keys are {', '.join(sorted(names))}")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value or {}, f"{prefix}{name}.")
        else:
            kwargs[name] = _check_type(f"{prefix}{name}", value, hint)
    return cls(**kwargs)


def parse_overrides(args: list[str]) -> dict:
    """['--train.epochs', '5', 'optim.lr=0.1'] -> {'train': {'epochs': 5}, 'optim': {'lr': 0.1}}."""
    import yaml  # noqa: PLC0415 - where values are read: hvdgen imports this module with only click installed

    tree: dict = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if "=" in arg:
            key, raw = arg.split("=", 1)
            i += 1
        elif arg.startswith("--") and i + 1 < len(args):
            key, raw = arg, args[i + 1]
            i += 2
        else:
            raise ConfigError(f"cannot read override {arg!r}: write --section.key VALUE or section.key=VALUE")
        node = tree
        *parents, leaf = key.removeprefix("--").split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(raw)
    return tree


def _merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = _merge(merged.get(key) or {}, value) if isinstance(value, dict) else value
    return merged


def partition_spec(text: str) -> str | list:
    """'params' | 'time' stay as they are; '3,fc2' becomes [3, 'fc2'] (indices or block names)."""
    if text in ("params", "time"):
        return text
    return [int(part) if part.strip().isdigit() else part.strip() for part in text.split(",") if part.strip()]


# A pipeline's schedules by name (hvd_runtime.pipeline.schedule builds each), and those that give
# each rank several chunks (parallel.chunks).
SCHEDULE_NAMES = ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "1f1b-batched-w")
INTERLEAVED = ("interleaved-1f1b",)


def interleaved_fit(name: str, stages: int, micro_batches: int) -> int | None:
    """The micro-batches schedule `name` takes instead of `micro_batches`, or None when those fit: an
    interleaved schedule sends micro-batches round the stages in groups of `stages`, so m must be a
    multiple of them."""
    if name not in INTERLEAVED or micro_batches % stages == 0:
        return None
    return micro_batches + stages - micro_batches % stages


def interleaved_misfit(name: str, stages: int, micro_batches: int) -> str | None:
    """Why schedule `name` cannot take `micro_batches` per batch, in the config's words, or None."""
    fit = interleaved_fit(name, stages, micro_batches)
    return None if fit is None else (f"parallel.micro_batches {micro_batches} is not a multiple of parallel.stages "
                                     f"{stages}: {name} sends micro-batches round the stages in groups of {stages}; "
                                     f"use {fit}")


# Settings with a fixed set of values: checked at start-up, before any rank does work.
CHOICES = {
    "data.source": ("digits", "npz", "image_folder", "tokens", "synthetic"),
    "train.precision": ("fp32", "bf16", "fp16"),
    "train.on_nonfinite": NONFINITE_POLICIES,
    "optim.name": ("sgd", "adam", "adamw"),
    "parallel.schedule": SCHEDULE_NAMES,
    "tracking.checkpoint_models": ("auto", "every", "final"),
    "model.recompute": ("none", "blocks"),
    "train.compile": ("auto", "on", "off"),
    "horovod.zero": (0, 1, 2, 3),
}
POSITIVE = ("train.grace_s", "optim.lr")
AT_LEAST_ONE = ("train.epochs", "train.batch_size", "train.eval_batch_size", "checkpoint.keep",
                "horovod.backward_passes_per_step", "horovod.elastic_commit_every", "parallel.stages",
                "parallel.micro_batches", "parallel.chunks", "model.width", "model.layers", "model.heads",
                "model.context", "model.vocab_multiple", "data.image_size", "data.synthetic_samples",
                "data.synthetic_features", "data.synthetic_classes")
AT_LEAST_ZERO = ("data.workers", "optim.clip_norm", "optim.weight_decay", "optim.warmup_epochs",
                 "horovod.threads_per_rank", "horovod.cycle_time_ms", "train.log_every", "train.hang_timeout_s",
                 "train.hang_allowance_s", "train.max_skipped", "checkpoint.every_steps", "checkpoint.max_failures")
FRACTIONS = ("data.val_fraction", "model.dropout", "optim.momentum")   # 0 or more, less than 1


def check_values(config) -> None:
    flat = flatten(config)
    for key, allowed in CHOICES.items():
        if key in flat and flat[key] not in allowed:
            raise ConfigError(f"{key} is {flat[key]!r}: choose one of {', '.join(map(str, allowed))}")
    for key in AT_LEAST_ONE:
        if key in flat and flat[key] < 1:
            raise ConfigError(f"{key} must be at least 1, got {flat[key]}")
    for key in POSITIVE:
        if key in flat and flat[key] <= 0:
            raise ConfigError(f"{key} must be more than 0, got {flat[key]}")
    for key in AT_LEAST_ZERO:
        if key in flat and flat[key] < 0:
            raise ConfigError(f"{key} must be 0 or more, got {flat[key]}")
    for key in FRACTIONS:
        if key in flat and not 0 <= flat[key] < 1:
            raise ConfigError(f"{key} must be 0 or more and less than 1, got {flat[key]}")
    if "parallel.schedule" in flat:
        misfit = interleaved_misfit(flat["parallel.schedule"], flat["parallel.stages"], flat["parallel.micro_batches"])
        if misfit:
            raise ConfigError(misfit)
        if flat["parallel.schedule"] in INTERLEAVED and flat["parallel.chunks"] < 2:
            raise ConfigError(f"parallel.chunks {flat['parallel.chunks']} gives each rank one chunk: "
                              f"{flat['parallel.schedule']} needs 2 or more (with one, use schedule 1f1b)")
    if flat.get("data.source") in ("npz", "image_folder", "tokens") and not flat.get("data.path"):
        raise ConfigError(f"data.source {flat['data.source']} needs data.path: e.g. --data.path my_data.npz")


# Keys renamed in this release, old name -> new: the old one still works, rank 0 saying so in one line.
RENAMED = {"parallel.virtual_stages": "parallel.chunks"}


def _renamed(data: dict, where: str) -> dict:
    """`data` with each renamed key under its new name."""
    if not isinstance(data, dict):
        return data   # _build says what it should be
    for old, new in RENAMED.items():
        (section, old_key), new_key = old.split("."), new.split(".")[1]
        node = data.get(section)
        if not isinstance(node, dict) or old_key not in node:
            continue
        if new_key in node:
            raise ConfigError(f"{old} and {new} are both set {where}: keep {new} ({old} is its old name)")
        data = {**data, section: {(new_key if key == old_key else key): value for key, value in node.items()}}
        if launch_rank() == 0:
            print(f"config: {old} is now called {new}; the old name works in this release: rename it {where}",
                  file=sys.stderr)
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, cls=RunConfig):
    """Read `path` (if given), apply `overrides`, validate against `cls`."""
    import yaml  # noqa: PLC0415 - where a file is read: hvdgen imports this module with only click installed

    data = {}
    if path is not None:
        data = yaml.safe_load(Path(path).read_text()) or {}
    data = _renamed(data, f"in {path}")
    config = _build(cls, _merge(data, _renamed(parse_overrides(overrides or []), "on the command line")))
    check_values(config)
    return config


def to_dict(config) -> dict:
    return dataclasses.asdict(config)


def flatten(config) -> dict[str, object]:
    """{'optim.lr': 0.05, ...}: the form trackers and summaries want."""
    out: dict[str, object] = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                out[f"{prefix}{key}"] = value

    walk(to_dict(config), "")
    return out


__all__ = ["ConfigError", "RunConfig", "load_config", "parse_overrides", "to_dict", "flatten", "types"]

"""ProjectSpec: every answer that shapes a generated project, validated before anything is written."""

from __future__ import annotations

import keyword
import re
from dataclasses import asdict, dataclass, field

import yaml

from hvd_runtime.config import INTERLEAVED, HorovodConfig, ParallelConfig, TrainConfig, interleaved_fit
from hvd_runtime.pipeline.schedule import SPLIT_BACKWARD_TORCH_ONLY
from hvdgen import __version__, catalog
from hvdgen.errors import HvdgenError

SPEC_FILE = ".hvdgen.yaml"
# A letter first, a letter or digit last, single '-' or '_' between: a valid distribution name
# (PEP 508) whose image tag and Kubernetes names come out the same (no '--' to collapse).
_NAME = re.compile(r"[A-Za-z](?:[A-Za-z0-9]|[-_](?=[A-Za-z0-9]))*")
MAX_NAME = 63  # it names the Kubernetes job, its pods and the image: DNS labels hold 63 characters
# Distributions a project installs or imports: a project of the same name would replace or shadow one.
TAKEN_NAMES = frozenset({"hvdgen", "hvd-runtime", "horovod", "torch", "tensorflow", "keras", "mlflow", "numpy",
                         "scikit-learn", "sklearn", "matplotlib", "pytest", "click", "jinja2", "pyyaml", "yaml",
                         "tqdm", "cloudpickle", "psutil", "packaging", "cffi", "jsonschema", "safetensors",
                         "setuptools", "pip", "wheel", "hatchling", "cmake", "train", "model", "data", "tests"})


def package_name(name: str) -> str:
    """The import name of a project: PEP 503-style normalisation to an identifier."""
    return re.sub(r"[-_.]+", "_", name).lower()


def validate_name(name: str) -> str:
    if not isinstance(name, str) or not name:
        raise HvdgenError("project name is empty: give a name such as 'mnist_ddp'")
    if len(name) > MAX_NAME:
        raise HvdgenError(f"project name is {len(name)} characters long: use at most {MAX_NAME} "
                          "(it also names the Kubernetes job and the image)")
    if not _NAME.fullmatch(name):
        raise HvdgenError(f"project name {name!r} is not allowed: use letters, digits and single '-' or '_' "
                          "between them, starting with a letter and ending with a letter or digit (e.g. 'mnist-ddp')")
    package = package_name(name)
    if package.replace("_", "-") in TAKEN_NAMES:
        raise HvdgenError(f"project name {name!r} is the name of a package the project uses or contains: "
                          f"pick another, e.g. 'my-{name}'")
    if keyword.iskeyword(package) or keyword.issoftkeyword(package):
        raise HvdgenError(f"project name {name!r} is a Python keyword: pick another, e.g. '{package}_project'")
    if not package.isidentifier():
        raise HvdgenError(f"project name {name!r} does not give a valid Python package name ({package!r}): "
                          "use letters, digits and '_' only")
    return name


@dataclass(frozen=True)
class ProjectSpec:
    """The answers of `hvdgen new`; also written to the project as .hvdgen.yaml."""

    name: str
    framework: str = "torch"
    strategy: str = "data"
    model: str = "mlp"     # mlp | resnet18 | gpt (catalog.MODELS)
    size: str = catalog.DEFAULT_SIZE   # a GPT's shape (catalog.GPT_SIZES); the other models have one
    elastic: bool = False  # Horovod elastic: survive lost workers (hvd.elastic.run, host discovery)
    stages: int = ParallelConfig.stages  # model-split: devices per worker; pipeline: ranks per pipeline
    micro_batches: int = ParallelConfig.micro_batches
    schedule: str = ParallelConfig.schedule
    tp: int | None = None  # tensor (default 2) and pipeline (default 1: stages unsplit): ranks per tensor-parallel group
    zero: int = HorovodConfig.zero  # horovod.zero (data; torch also tensor, pipeline): 1 optimizer state, 2 gradients, 3 params
    hvdgen_version: str = field(default=__version__)
    k8s: dict = field(default_factory=dict)  # answers of `hvdgen k8s`; see hvdgen/k8s/options.py
    slurm: dict = field(default_factory=dict)  # answers of `hvdgen slurm`; see hvdgen/slurm/options.py

    def __post_init__(self) -> None:
        validate_name(self.name)
        if self.tp is None:  # frozen: the default depends on the strategy
            object.__setattr__(self, "tp", 2 if self.strategy == "tensor" else 1)
        for key in ("framework", "strategy", "model", "size", "schedule", "hvdgen_version"):
            if not isinstance(getattr(self, key), str):
                raise HvdgenError(f"{key} must be text, got {getattr(self, key)!r}: e.g. {key}: "
                                  f"{getattr(ProjectSpec, key, None) or __version__}")
        if not isinstance(self.elastic, bool):
            raise HvdgenError(f"elastic must be true or false, got {self.elastic!r}")
        for key in ("k8s", "slurm"):
            if not isinstance(getattr(self, key), dict):
                raise HvdgenError(f"{key} must be a mapping of the hvdgen {key} answers, got {getattr(self, key)!r}: "
                                  f"remove it, then run hvdgen {key} to write it again")
        _check_version(self.hvdgen_version)
        if self.framework not in catalog.FRAMEWORKS:
            raise HvdgenError(f"unknown framework {self.framework!r}: choose one of {', '.join(catalog.FRAMEWORKS)}")
        if self.strategy not in catalog.STRATEGIES:
            raise HvdgenError(f"unknown strategy {self.strategy!r}: choose one of {', '.join(catalog.STRATEGIES)}")
        if not catalog.is_available(self.framework, self.strategy):
            offered = ", ".join(f"{f}/{s}" for f, s in catalog.AVAILABLE)
            raise HvdgenError(f"{self.framework}/{self.strategy} is not available in hvdgen {__version__}: "
                              f"choose one of {offered} (see hvdgen list)")
        if self.model not in catalog.MODELS:
            raise HvdgenError(f"unknown model {self.model!r}: choose one of {', '.join(catalog.MODELS)}")
        if not _whole(self.stages) or self.stages < 2:
            raise HvdgenError(f"--stages must be an integer of at least 2, got {self.stages!r}: e.g. --stages 2")
        if self.size not in catalog.GPT_SIZES:
            raise HvdgenError(f"unknown size {self.size!r}: choose one of {', '.join(catalog.GPT_SIZES)}")
        if self.size != catalog.DEFAULT_SIZE and self.model != "gpt":
            raise HvdgenError(f"--size {self.size} is a size of the GPT, and the {self.model} model has one: "
                              f"use --model gpt, or leave --size out")
        model = self.model_info
        if self.stages > model.blocks:
            raise HvdgenError(f"--stages {self.stages} is more than the {model.blocks} blocks of the generated "
                              f"{self.model} ({model.block_names}): use --stages {model.blocks} or fewer; for more, "
                              f"{model.more_blocks} and raise parallel.stages there")
        if not _whole(self.micro_batches) or self.micro_batches < 1:
            raise HvdgenError(f"--micro-batches must be a positive integer, got {self.micro_batches!r}: "
                              "e.g. --micro-batches 4")
        if self.micro_batches > self.batch_size:
            raise HvdgenError(f"--micro-batches {self.micro_batches} is more than the {self.batch_size} samples of a batch "
                              f"per rank: use at most {self.batch_size}; for more, raise train.batch_size in config.yaml "
                              "and parallel.micro_batches there")
        if self.schedule not in catalog.SCHEDULES:
            raise HvdgenError(f"unknown schedule {self.schedule!r}: choose one of {', '.join(catalog.SCHEDULES)}")
        if self.schedule not in catalog.schedules(self.framework):
            raise HvdgenError(f"--schedule {self.schedule} {SPLIT_BACKWARD_TORCH_ONLY}: "
                              "use --schedule 1f1b, or --framework torch")
        if self.strategy == "pipeline" and self.schedule in INTERLEAVED:
            self._check_interleaved(model)
        if self.elastic and self.strategy in ("pipeline", "tensor"):
            lost = "a stage" if self.strategy == "pipeline" else "a slice of every layer"
            raise HvdgenError(f"--elastic works with the data and model-split strategies: a {self.strategy} job cannot "
                              f"lose {lost}; drop --elastic or use --strategy data")
        self._check_zero()
        if self.strategy == "tensor" or (self.strategy == "pipeline" and self.tp != 1):
            self._check_tensor()
        elif self.tp != 1:
            raise HvdgenError(f"tp {self.tp!r} applies to the tensor and pipeline strategies, not {self.strategy}: "
                              "drop it (tp: 1), or use --strategy tensor")

    def _check_zero(self) -> None:
        if not _whole(self.zero) or not 0 <= self.zero <= 3:
            raise HvdgenError(f"--zero must be 0, 1, 2 or 3, got {self.zero!r}: e.g. --zero 2")
        if self.zero and self.framework == "tensorflow" and (self.strategy != "data" or self.zero > 2):
            raise HvdgenError(f"--zero {self.zero} with --framework tensorflow: Keras shards a data-parallel job's "
                              "optimizer state and gradients (--zero 1 or 2, --strategy data); use --framework torch "
                              "for more")
        if self.zero and self.strategy not in ("data", "tensor", "pipeline"):
            raise HvdgenError(f"--zero {self.zero} shards a data, tensor or pipeline job, not {self.strategy}: drop "
                              "--zero, or use --strategy data")
        if self.zero > 1 and self.strategy == "pipeline":
            raise HvdgenError(f"--zero {self.zero} with --strategy pipeline: every micro-batch's backward would "
                              "reduce-scatter again; use --zero 1 (the optimizer state over each stage's replicas)")
        if self.zero and self.strategy == "pipeline" and self.tp != 1:
            raise HvdgenError(f"--zero {self.zero} with --tp {self.tp}: ZeRO shards the stages of a pipeline "
                              "without tensor parallelism; drop one of them")
        if self.zero and self.elastic:
            raise HvdgenError(f"--zero {self.zero} with --elastic: a lost worker would take its shard with it; "
                              "drop one of them")

    def _check_interleaved(self, model) -> None:
        """Interleaved 1F1B cuts the model into stages x chunks pieces and sends micro-batches
        round the stages in groups of `stages`."""
        pieces = self.stages * self.chunks
        if pieces > model.blocks:
            raise HvdgenError(f"--schedule {self.schedule} cuts the model into --stages {self.stages} x "
                              f"{self.chunks} chunks = {pieces} pieces, more than the {model.blocks} blocks of "
                              f"the generated {self.model} ({model.block_names}): use --stages "
                              f"{model.blocks // self.chunks} or fewer, or --schedule 1f1b")
        fits = interleaved_fit(self.schedule, self.stages, self.micro_batches)
        if fits is not None:
            raise HvdgenError(f"--micro-batches {self.micro_batches} is not a multiple of --stages {self.stages}: "
                              f"--schedule {self.schedule} sends micro-batches round the stages in groups of "
                              f"{self.stages}; use --micro-batches {fits}")
        if self.tp != 1:
            raise HvdgenError(f"--schedule {self.schedule} does not split stages over tensor-parallel ranks: drop --tp, "
                              "or use --schedule 1f1b")

    @property
    def batch_size(self) -> int:
        """config.yaml's train.batch_size (per rank): the GPT size's, else the config's default."""
        return self.gpt_size.batch_size if self.model == "gpt" else TrainConfig.batch_size

    @property
    def eval_batch_size(self) -> int:
        """config.yaml's train.eval_batch_size: twice a GPT size's batch (a window is long), else the default."""
        return 2 * self.gpt_size.batch_size if self.model == "gpt" else TrainConfig.eval_batch_size

    @property
    def chunks(self) -> int:
        """Chunks of the model per rank the generated config starts with (parallel.chunks, used by
        the interleaved schedule): the config's default; 2 halves 1F1B's bubble for twice its messages."""
        return ParallelConfig.chunks

    def _check_tensor(self) -> None:
        heads = self.model_info.heads
        least = 2 if self.strategy == "tensor" else 1
        if not _whole(self.tp) or self.tp < least:
            raise HvdgenError(f"--tp must be an integer of at least {least}, got {self.tp!r}: e.g. --tp 2")
        if not heads:
            raise HvdgenError(f"--strategy {self.strategy}{' --tp' if self.strategy == 'pipeline' else ''} splits "
                              f"attention heads and MLPs, and the {self.model} model has none: use --model gpt, "
                              f"or {'drop --tp' if self.strategy == 'pipeline' else '--strategy data'} for this one")
        if heads % self.tp:
            fits = " or ".join(str(n) for n in range(2, heads + 1) if heads % n == 0)
            raise HvdgenError(f"--tp {self.tp} does not divide the generated {self.model}'s {heads} attention heads: "
                              f"use --tp {fits}; for more, raise model.heads in config.yaml and parallel.tp there")

    @property
    def package(self) -> str:
        return package_name(self.name)

    @property
    def model_info(self) -> catalog.Model:
        """The model at this project's size: its blocks and attention heads."""
        return catalog.model_at(self.model, self.size)

    @property
    def gpt_size(self) -> catalog.GptSize:
        return catalog.GPT_SIZES[self.size]

    @property
    def model_ranks(self) -> int:
        """Ranks that together hold one copy of the model: a pipeline's stages x tp, a tensor-parallel
        group's tp, else 1. The world (-np) is a multiple of it: model_ranks x replicas."""
        return {"pipeline": self.stages * self.tp, "tensor": self.tp}.get(self.strategy, 1)

    @property
    def tp_stages(self) -> bool:
        """A pipeline whose stages may be split by tensor parallelism (parallel.tp, 1 by default): a
        pipeline of a model with attention heads. Its train.py splits and gathers them."""
        return self.strategy == "pipeline" and self.model_info.heads > 0

    @property
    def cpu_np(self) -> int:
        """Ranks of the smallest run on one CPU: one copy of a split model (model_ranks), else 2 workers."""
        return self.model_ranks if self.strategy in ("pipeline", "tensor") else 2

    @property
    def ranks_per_gpu_node(self) -> int:
        """Ranks on a 4-GPU node (8 for a pipeline of more than 2 stages): one GPU per rank, except
        model-split, where each rank drives `stages` GPUs."""
        if self.strategy == "model-split":
            return max(1, 4 // self.stages)
        if self.strategy == "pipeline":
            return self.model_ranks * max(1, 4 // self.model_ranks)
        return 4

    def to_yaml(self) -> str:
        return yaml.safe_dump(asdict(self), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> "ProjectSpec":
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            line = f" at line {where.line + 1}" if where else ""
            raise HvdgenError(f"{SPEC_FILE} is not valid YAML{line}: fix it, or regenerate the project with "
                              "hvdgen new --force") from exc
        if not isinstance(data, dict) or "name" not in data:
            raise HvdgenError(f"{SPEC_FILE} does not hold a project's answers (a mapping with at least 'name'): "
                              "restore it, or regenerate the project with hvdgen new --force")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise HvdgenError(f"{SPEC_FILE} has unknown keys {sorted(map(str, unknown))}: remove them or regenerate "
                              "the project")
        try:
            return cls(**data)
        except HvdgenError as exc:
            raise HvdgenError(f"{SPEC_FILE}: {exc.message}") from exc


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_version(version: str) -> None:
    """A recorded hvdgen version must be a real one, and not newer than this hvdgen."""
    from packaging.version import InvalidVersion, Version

    try:
        recorded = Version(version)
    except InvalidVersion:
        raise HvdgenError(f"hvdgen_version {version!r} is not a version number: restore it "
                          f"(this hvdgen is {__version__})") from None
    if recorded > Version(__version__):
        raise HvdgenError(f"the project was made by hvdgen {version}, newer than this hvdgen {__version__}: "
                          f"upgrade hvdgen (pip install -U hvdgen)")

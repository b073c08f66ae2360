"""ProjectSpec: every answer that shapes a generated project, validated before anything is written."""

from __future__ import annotations

import keyword
import re
from dataclasses import asdict, dataclass, field

import yaml

from hvdgen import __version__, catalog
from hvdgen.errors import HvdgenError

SPEC_FILE = ".hvdgen.yaml"
SCHEDULES = ("gpipe", "1f1b")
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")


def package_name(name: str) -> str:
    """The import name of a project: PEP 503-style normalisation to an identifier."""
    return re.sub(r"[-_.]+", "_", name).lower()


def validate_name(name: str) -> str:
    if not name:
        raise HvdgenError("project name is empty: give a name such as 'mnist_ddp'")
    if not _NAME.fullmatch(name):
        raise HvdgenError(f"project name {name!r} is not allowed: use letters, digits, '-' and '_', "
                          "starting with a letter (e.g. 'mnist-ddp')")
    package = package_name(name)
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
    elastic: bool = False  # Horovod elastic: survive lost workers (hvd.elastic.run, host discovery)
    stages: int = 2        # model-split: devices per worker; pipeline: ranks per pipeline
    micro_batches: int = 4
    schedule: str = "1f1b"
    hvdgen_version: str = field(default=__version__)
    k8s: dict = field(default_factory=dict)  # answers of `hvdgen k8s`; see hvdgen/k8s/options.py

    def __post_init__(self) -> None:
        validate_name(self.name)
        if self.framework not in catalog.FRAMEWORKS:
            raise HvdgenError(f"unknown framework {self.framework!r}: choose one of {', '.join(catalog.FRAMEWORKS)}")
        if self.strategy not in catalog.STRATEGIES:
            raise HvdgenError(f"unknown strategy {self.strategy!r}: choose one of {', '.join(catalog.STRATEGIES)}")
        if not catalog.is_available(self.framework, self.strategy):
            offered = ", ".join(f"{f}/{s}" for f, s in catalog.AVAILABLE)
            raise HvdgenError(f"{self.framework}/{self.strategy} is not available in hvdgen {__version__}: "
                              f"choose one of {offered} (see hvdgen list)")
        if not isinstance(self.stages, int) or self.stages < 2:
            raise HvdgenError(f"--stages must be an integer of at least 2, got {self.stages!r}: e.g. --stages 2")
        if not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise HvdgenError(f"--micro-batches must be a positive integer, got {self.micro_batches!r}: "
                              "e.g. --micro-batches 4")
        if self.schedule not in SCHEDULES:
            raise HvdgenError(f"unknown schedule {self.schedule!r}: choose one of {', '.join(SCHEDULES)}")
        if self.elastic and self.strategy == "pipeline":
            raise HvdgenError("--elastic works with the data and model-split strategies: a pipeline cannot lose "
                              "a stage; drop --elastic or use --strategy data")

    @property
    def package(self) -> str:
        return package_name(self.name)

    def to_yaml(self) -> str:
        return yaml.safe_dump(asdict(self), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> "ProjectSpec":
        data = yaml.safe_load(text) or {}
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise HvdgenError(f"{SPEC_FILE} has unknown keys {sorted(unknown)}: remove them or regenerate the project")
        return cls(**data)

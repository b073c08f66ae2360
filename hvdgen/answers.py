"""The answers of a command that writes one folder of a project again (`hvdgen k8s`, `hvdgen slurm`).

They are stored in `.hvdgen.yaml` under the command's name as a plain mapping, so a later run
starts from the last answers and only the options given on its command line change. Read back,
they may hold anything: each is checked against its field's type here, then by the options'
own rules.
"""

from __future__ import annotations

from dataclasses import asdict, fields, replace
from typing import ClassVar

from hvdgen.errors import HvdgenError

_KINDS = {bool: "true or false", int: "a whole number", str: "text"}


def flag(name: str) -> str:
    """The command-line option of an answer."""
    return name.replace("_", "-")


class Answers:
    """Mixed into a frozen dataclass of one command's answers."""

    SECTION: ClassVar[str]  # the command, and its key in .hvdgen.yaml
    EXAMPLES: ClassVar[dict[str, str]] = {}  # what to write for a text answer whose default is empty
    RANGES: ClassVar[tuple[tuple[str, int, int, int], ...]] = ()  # (count, smallest, largest, example)

    def check_fields(self) -> None:
        """Each answer of its field's type, each count in its range."""
        for spec in fields(self):
            self._check_type(spec.name, getattr(self, spec.name), spec.default)
        for name, low, high, example in self.RANGES:
            value = getattr(self, name)
            if not low <= value <= high:
                raise HvdgenError(f"--{flag(name)} must be between {low} and {high}, got {value}: "
                                  f"e.g. --{flag(name)} {example}")

    def _check_type(self, name: str, value, default) -> None:
        wanted = type(default)
        if isinstance(value, wanted) and (wanted is bool or not isinstance(value, bool)):
            return
        example = (str(default).lower() if wanted is bool else default if default not in ("", 0)
                   else self.EXAMPLES.get(name, default))
        raise HvdgenError(f".hvdgen.yaml {self.SECTION}: {name} must be {_KINDS[wanted]}, got {value!r}: write e.g. "
                          f"{name}: {example}, or remove the line")

    def to_answers(self) -> dict:
        return asdict(self)

    @classmethod
    def from_answers(cls, answers: dict | None):
        answers = dict(answers or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(map(str, set(answers) - known))
        if unknown:
            raise HvdgenError(f".hvdgen.yaml {cls.SECTION} has unknown keys {unknown}: remove them "
                              f"(known: {', '.join(sorted(known))})")
        return cls(**answers)

    def with_changes(self, changes: dict):
        """These answers with the given options changed; None means "keep the recorded answer"."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

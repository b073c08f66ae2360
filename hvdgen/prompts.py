"""`hvdgen new` in a terminal without options: ask for each answer, as cookiecutter does.

Each question shows its choices and a default, which Enter takes. An answer is checked by the
rules the flags go through (ProjectSpec), together with the answers before it, so a refused one
is asked again with the same reason a flag would get. Questions that do not apply to the
strategy chosen are not asked. Ctrl-C stops before anything is written.
"""

from __future__ import annotations

import click

from hvdgen import catalog
from hvdgen.errors import HvdgenError
from hvdgen.spec import ProjectSpec, validate_name


def ask(name: str | None) -> dict:
    """The answers `hvdgen new` takes as flags: name, framework, strategy, model, and what applies."""
    if name is None:
        name = click.prompt("Project name", value_proc=_checked(validate_name))
    answers: dict = {"name": name}
    _ask(answers, "framework", "Framework", click.Choice(catalog.FRAMEWORKS), "torch")
    strategies = [s for s in catalog.STRATEGIES if catalog.is_available(answers["framework"], s)]
    _ask(answers, "strategy", "Strategy", click.Choice(strategies), "data")
    strategy = answers["strategy"]
    models = [m for m in catalog.MODELS if catalog.splits(strategy, m)]
    _ask(answers, "model", "Model", click.Choice(models), catalog.default_model(strategy))
    if strategy in ("model-split", "pipeline"):
        _ask(answers, "stages", "Stages", click.IntRange(min=2), 2)
        _ask(answers, "micro_batches", "Micro-batches per batch", click.IntRange(min=1), 4)
    if strategy == "pipeline":
        _ask(answers, "schedule", "Schedule", click.Choice(catalog.schedules(answers["framework"])), "1f1b")
    if strategy == "tensor":
        _ask(answers, "tp", "Ranks per tensor-parallel group (tp)", click.IntRange(min=2), 2)
    if strategy in ("data", "model-split"):
        answers["elastic"] = click.confirm("Elastic (survive lost workers, rescale to the hosts found)?",
                                           default=False)
    return answers


def _ask(answers: dict, key: str, question: str, kind: click.ParamType, default) -> None:
    """Ask until the answer passes kind's check and ProjectSpec's rules with the answers so far."""

    def fits(value):
        trial = {**answers, key: value}
        trial.setdefault("model", catalog.default_model(trial.get("strategy", "data")))   # not asked yet
        ProjectSpec(**trial)

    answers[key] = click.prompt(question, type=kind, default=default, value_proc=_checked(fits, kind))


def _checked(check, kind: click.ParamType | None = None):
    """A value_proc for click.prompt: convert with `kind`, then `check`; a refusal is asked again."""

    def proc(text):
        value = kind.convert(text, None, None) if kind is not None else text
        try:
            result = check(value)
        except HvdgenError as exc:
            raise click.UsageError(str(exc)) from None
        return value if result is None else result

    return proc

"""The `hvdgen` command line. Heavy imports (torch, tensorflow, mlflow) stay inside the commands."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from hvdgen import __version__, catalog


class _Commands(click.Group):
    """Every command's failures reach the user as one line: a usage error names the option and
    where help is, and an OS error (a read-only folder, a full disk) is a problem of this machine
    the user can fix, not a bug to show a traceback for."""

    def main(self, args=None, prog_name=None, **extra):
        try:
            code = super().main(args, prog_name, standalone_mode=False, **extra)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx else "hvdgen"
            click.echo(f"Error: {exc.format_message()} (see {where} --help)", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except OSError as exc:
            where = f": {exc.filename}" if exc.filename else ""
            raise click.ClickException(f"{exc.strerror or exc}{where}: check the path and its permissions") from exc


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hvdgen")
def main() -> None:
    """Generate Horovod distributed-training projects for PyTorch and TensorFlow."""


@main.command("install-horovod")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=lambda: os.cpu_count() or 1, show_default="cores",
              help="Parallel compile jobs.")
@click.option("--force", is_flag=True, help="Rebuild even if a cached wheel matches.")
@click.option("--cpu-only", is_flag=True,
              help="Leave out GPU ops (NCCL) even for a CUDA build of torch, e.g. where no CUDA compiler or NCCL is "
                   "at hand; cached under its own key.")
@click.option("--cuda-arch", envvar="HVDGEN_CUDA_ARCH", metavar="CC[,CC...]",
              help="Compile Horovod's CUDA kernels only for these compute capabilities, e.g. 90 (H100) or 80,90: "
                   "minutes shorter than the default, every GPU the toolkit knows; cached under its own key. "
                   "Also read from HVDGEN_CUDA_ARCH.")
def install_horovod_cmd(jobs: int, force: bool, cpu_only: bool, cuda_arch: str | None) -> None:
    """Build Horovod for the installed frameworks (cached), then install it.

    A CUDA build of torch gets NCCL ops, compiled with the CUDA toolkit and NCCL found here
    (CUDA_HOME/CUDA_PATH, nvcc on PATH, /usr/local/cuda, pip's nvidia wheels).
    """
    from hvdgen.build.horovod_wheel import install_horovod

    install_horovod(jobs=jobs, force=force, cpu_only=cpu_only, cuda_arch=cuda_arch)


@main.command("list")
def list_cmd() -> None:
    """Show every framework x strategy and whether this release can generate it."""
    from hvdgen.catalog import model_rows, rows

    for framework, strategy, available, what in rows():
        mark = "available" if available else "planned  "
        click.echo(f"{framework:<11} {strategy:<12} {mark}  {what}")
    click.echo("\nmodels (--model), each for every available framework x strategy above (tensor splits the gpt):")
    for model, what in model_rows():
        click.echo(f"{model:<11} {what}")


# The options that answer a question of `hvdgen new`: with none of them, a terminal is asked instead.
ANSWERS = ("framework", "strategy", "model", "stages", "micro_batches", "schedule", "tp", "elastic")


@main.command("new")
@click.argument("name", required=False)
@click.option("--framework", "-f", type=click.Choice(catalog.FRAMEWORKS), default="torch", show_default=True,
              help="The framework.")
@click.option("--strategy", "-s", type=click.Choice(catalog.STRATEGIES), default="data", show_default=True,
              help="The parallel strategy.")
@click.option("--model", "-m", type=click.Choice(list(catalog.MODELS)), default=None,
              help="The model (see hvdgen list) [mlp; gpt for tensor].")
@click.option("--size", type=click.Choice(list(catalog.GPT_SIZES)), default=catalog.DEFAULT_SIZE, show_default=True,
              help="gpt: its shape in config.yaml; gpt2-small is GPT-2's 124 M (12 layers, width 768, context 1024).")
@click.option("--output", "-o", type=click.Path(file_okay=False, path_type=Path), default=Path("."),
              show_default=True, help="Directory in which the project folder NAME is created.")
@click.option("--stages", type=int, default=None, help="model-split / pipeline: number of stages [2].")
@click.option("--micro-batches", type=int, default=None, help="model-split / pipeline: micro-batches per batch [4].")
@click.option("--schedule", type=click.Choice(catalog.SCHEDULES), default=None,
              help="pipeline: zb-h1 is zero bubble, 1f1b-batched-w batches weight gradients; both torch only [1f1b].")
@click.option("--tp", type=int, default=None,
              help="tensor: ranks per tensor-parallel group [2]; pipeline: each stage split over tp ranks [1].")
@click.option("--elastic", is_flag=True, help="Elastic training: survive lost workers, rescale to the hosts found.")
@click.option("--zero", type=click.IntRange(0, 3), default=0, show_default=True,
              help="data (torch): ZeRO over the ranks: 1 shards the optimizer state, 2 the gradients too, "
                   "3 the parameters too.")
@click.option("--dry-run", is_flag=True, help="Show the files that would be written; write nothing.")
@click.option("--force", is_flag=True, help="Write into an existing non-empty directory, overwriting generated files.")
@click.option("--no-input", is_flag=True, help="Never ask: take the flags and the defaults (as off a terminal).")
@click.pass_context
def new_cmd(ctx: click.Context, name: str | None, framework: str, strategy: str, model: str | None, size: str,
            stages: int | None, micro_batches: int | None, schedule: str | None, tp: int | None, elastic: bool,
            zero: int, output: Path, dry_run: bool, force: bool, no_input: bool) -> None:
    """Generate a training project NAME.

    In a terminal with none of the options that answer a question (framework to elastic), it asks
    for each of them, with choices and defaults; --no-input, or input or output that is not a
    terminal, never asks.
    """
    from hvdgen.errors import HvdgenError
    from hvdgen.render import generate
    from hvdgen.spec import ProjectSpec

    given_any = any(ctx.get_parameter_source(key) is not click.core.ParameterSource.DEFAULT for key in ANSWERS)
    if not no_input and not given_any and sys.stdin.isatty() and sys.stdout.isatty():
        from hvdgen.prompts import ask

        answers = ask(name)   # the questions that apply: the others keep their flags' defaults
        name, framework, strategy, model = (answers[k] for k in ("name", "framework", "strategy", "model"))
        elastic = answers.get("elastic", False)
        stages, micro_batches, schedule, tp = (answers.get(k) for k in ("stages", "micro_batches", "schedule", "tp"))
    if name is None:
        raise click.UsageError("Missing argument 'NAME': e.g. hvdgen new myproject", ctx)

    staged = {"stages": stages, "micro_batches": micro_batches, "schedule": schedule}
    given = {k: v for k, v in staged.items() if v is not None}
    if given and strategy in ("data", "tensor"):
        flag = "--" + next(iter(given)).replace("_", "-")
        raise HvdgenError(f"{flag} applies to --strategy model-split or pipeline, not {strategy}: drop it or pick one")
    if tp is not None and strategy not in ("tensor", "pipeline"):
        raise HvdgenError(f"--tp applies to --strategy tensor or pipeline, not {strategy}: drop it, or use "
                          "--strategy tensor")
    if tp is not None:
        given["tp"] = tp
    if schedule is not None and strategy == "model-split":
        raise HvdgenError("--schedule applies to --strategy pipeline (model-split runs its micro-batches in order): "
                          "drop --schedule, or use --strategy pipeline")
    if model is None:
        from hvdgen import catalog

        model = catalog.default_model(strategy) if strategy in catalog.STRATEGIES else "mlp"
    spec = ProjectSpec(name=name, framework=framework, strategy=strategy, model=model, size=size, elastic=elastic,
                       zero=zero, **given)
    target = output / name
    result = generate(spec, target, force=force, dry_run=dry_run)
    if dry_run:
        click.echo(f"would write {len(result.files)} files to {target}:")
        for rel in result.files:
            click.echo(f"  {rel}")
        if result.plan is not None:
            click.echo("over the existing project, --force would change:")
            click.echo("\n".join(result.plan.lines()) or "  nothing")
        return
    click.echo(f"created {target} ({framework}, {strategy}, {model}, {len(result.files)} files)")
    if result.plan is not None:
        click.echo("\n".join(result.plan.lines()) or "  (no generated file changed)")
        for rel in result.plan.user_changed:
            click.echo(f"warning: you had changed {rel}; it is replaced, your version is kept beside it as .orig",
                       err=True)
    click.echo(f"next: cd {target} && make setup && make train")


@main.command("update")
@click.option("--project", "-p", type=click.Path(file_okay=False, path_type=Path), default=Path("."),
              show_default=True, help="The generated project to update.")
@click.option("--to", metavar="VERSION|WHEEL", default=None,
              help="Update to this hvdgen: an hvdgen wheel file, or a version pip can fetch [this hvdgen].")
@click.option("--conflict", type=click.Choice(catalog.CONFLICT_STYLES), default="inline", show_default=True,
              help="Where lines that you and hvdgen both changed go: marked inline, or yours kept and "
                   "hvdgen's in <file>.rej.")
@click.option("--dry-run", is_flag=True, help="Show the changes as a diff; write nothing.")
@click.option("--check", is_flag=True, help="Write nothing; exit 2 when an update exists, 0 when up to date.")
def update_cmd(project: Path, to: str | None, conflict: str, dry_run: bool, check: bool) -> int:
    """Carry a generated project to this hvdgen's templates, keeping your edits.

    A three-way merge, as copier's update: the project as its own hvdgen generated it (rendered
    again by the wheel the project carries, from .hvdgen.yaml), the project as it is, and the
    same answers rendered by this hvdgen. The result replaces the project in one step.
    """
    from hvdgen.update import show_diff, update_project

    outcome = update_project(project, to, conflict, dry_run=dry_run, check_only=check)
    if outcome.plan is None:
        click.echo(f"{project} is up to date ({outcome.versions})")
        return 0
    if check:
        click.echo(f"an update exists for {project}: {outcome.versions}; run hvdgen update --dry-run to see it")
        return 2
    plan = outcome.plan
    if dry_run:
        show_diff(Path(os.path.abspath(project)), plan)
        click.echo(f"hvdgen update --dry-run ({outcome.versions}) would change, writing nothing now:")
    else:
        click.echo(f"updated {project} ({outcome.versions}):")
    click.echo("\n".join(plan.lines(conflict)) or "  no file changes (only hvdgen's own records)")
    if plan.conflicts and not dry_run:
        where = "marked in the files" if conflict == "inline" else "in the .rej files beside them"
        click.echo(f"warning: {len(plan.conflicts)} file(s) have lines you and hvdgen both changed, {where}: "
                   f"{', '.join(plan.conflicts)}; resolve them by hand", err=True)
    return 0


@main.command("doctor")
def doctor_cmd() -> None:
    """Check that this environment can run a generated project."""
    from hvdgen.doctor import run_doctor

    raise SystemExit(run_doctor())


from hvdgen.timeline_command import timeline_cmd  # noqa: E402  (click only; heavy imports run inside)

main.add_command(timeline_cmd)

from hvdgen.k8s.command import k8s_cmd  # noqa: E402  (click only; validation imports run inside)

main.add_command(k8s_cmd)

from hvdgen.slurm.command import slurm_cmd  # noqa: E402  (click only; validation imports run inside)

main.add_command(slurm_cmd)

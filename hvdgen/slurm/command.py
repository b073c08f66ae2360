"""The `hvdgen slurm` command: write a project's slurm/train.sbatch again from its answers, or check a hand-edited one.

Options left out keep the answers recorded in .hvdgen.yaml, so `hvdgen slurm --nodes 4` changes the
node count and nothing else.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from hvdgen.errors import HvdgenError
from hvdgen.slurm.options import CONTROLLERS, MPI_PLUGINS


@click.command("slurm")
@click.option("--nodes", type=int, help="Nodes of the job, 1-1024 (default 2).")
@click.option("--gpus-per-node", type=int,
              help="GPUs a node, 0-64: one rank per GPU (model-split: a GPU per stage of each rank); 0 for CPU "
                   "nodes (default 4).")
@click.option("--tasks-per-node", type=int,
              help="CPU nodes (--gpus-per-node 0): ranks a node runs (default: 1, or a whole tensor-parallel group).")
@click.option("--partition", help="Slurm partition (default: the cluster's).")
@click.option("--time", help="Time limit, e.g. 1-00:00:00 or 90 (minutes) (default: the partition's).")
@click.option("--account", help="Account to charge (default: yours).")
@click.option("--controller", type=click.Choice(CONTROLLERS),
              help="gloo: one horovodrun on the batch node starts every rank over ssh (default; elastic projects "
                   "need it); mpi: srun starts the ranks, for a Horovod built with MPI.")
@click.option("--mpi-plugin", type=click.Choice(MPI_PLUGINS), help="With --controller mpi: srun --mpi=... (default pmix).")
@click.option("--grace-s", type=int,
              help="Seconds before the time limit when every rank checkpoints and the job requeues (default 120).")
@click.option("--project", type=click.Path(path_type=Path), default=Path("."), show_default=True,
              help="The project folder (holds .hvdgen.yaml).")
@click.option("--check", is_flag=True, help="Check slurm/train.sbatch (or --file) against the project and change nothing.")
@click.option("--file", "file_", help="With --check: a batch script to check instead of slurm/train.sbatch.")
def slurm_cmd(project: Path, check: bool, file_: str | None, **answers) -> None:
    """Write the project's Slurm batch script (slurm/train.sbatch), or check it with --check."""
    from hvdgen.regenerate import load_spec

    if check:
        _check(project, file_, answers, load_spec(project, "hvdgen slurm"))
        return
    if file_:
        raise HvdgenError("--file works with --check only: add --check")
    from hvdgen.overwrite import refresh_fingerprints
    from hvdgen.regenerate import rewrite
    from hvdgen.render import render_tree
    from hvdgen.slurm.layout import options_of
    from hvdgen.spec import SPEC_FILE

    spec = load_spec(project, "hvdgen slurm")
    opts = options_of(spec).updated(**answers)
    spec = dataclasses.replace(spec, slurm=opts.to_answers())
    # rendering refuses a shape that does not fit (hvdgen.slurm.layout), in the staging folder
    written = rewrite(project, spec, ["slurm/train.sbatch", "slurm/logs/.gitignore"],
                      lambda staging: render_tree(spec, staging, only="slurm"), "hvdgen slurm")
    refresh_fingerprints(project, written + [SPEC_FILE])
    click.echo(f"wrote {project / 'slurm' / 'train.sbatch'} and the slurm answers in .hvdgen.yaml")
    click.echo("next: sbatch slurm/train.sbatch" + ("" if project == Path(".") else f"  (in {project})"))


def _check(project: Path, file_: str | None, answers: dict, spec) -> None:
    given = sorted(k.replace("_", "-") for k, v in answers.items() if v is not None)
    if given:
        raise HvdgenError(f"--check changes nothing, so --{', --'.join(given)} do not apply: leave them out")
    from hvdgen.slurm.check import SCRIPT, check_script, mpi_built

    path = Path(file_) if file_ else project / SCRIPT
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise HvdgenError(f"{path} does not exist: write it with hvdgen slurm, or give --file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise HvdgenError(f"cannot read {path} ({getattr(exc, 'strerror', None) or exc}): fix the file") from exc
    problems = check_script(text, spec, str(path), project, mpi_built())
    for problem in problems:
        click.echo(str(problem), err=True)
    if problems:
        raise SystemExit(1)
    click.echo(f"{path}: fits the project ({spec.strategy}, {spec.model_ranks} rank(s) a copy of the model)")

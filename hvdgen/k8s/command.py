"""The `hvdgen k8s` command: re-render a project's k8s/ from its answers, or check hand-edited manifests.

Options left out keep the answers recorded in .hvdgen.yaml, so `hvdgen k8s --workers 4` changes the
worker count and nothing else.
"""

from __future__ import annotations

from pathlib import Path

import click

from hvdgen.errors import HvdgenError


@click.command("k8s")
@click.option("--workers", type=int, help="Worker pods, 1-1024 (default 2; pipeline: one per stage).")
@click.option("--gpus-per-worker", type=int,
              help="GPUs per worker in the gpu overlay, 0-64; 0 leaves it out (default 1; model-split: one per "
                   "stage, and always stages x ranks per worker).")
@click.option("--image", help="CPU job image, e.g. registry.example.com/team/mnist:v1 (default NAME:latest).")
@click.option("--gpu-image", help="CUDA job image (default: the CPU image's tag + '-cuda').")
@click.option("--namespace", help="Kubernetes namespace (default 'default').")
@click.option("--elastic/--no-elastic", default=None,
              help="Elastic Horovod: workers may come and go (default: as hvdgen new --elastic).")
@click.option("--min-workers", type=int, help="Elastic: fewest workers to keep training with (default 1).")
@click.option("--max-workers", type=int, help="Elastic: most workers to use (default --workers).")
@click.option("--non-root/--root", "non_root", default=None,
              help="Run pods as the images' mpiuser (uid 1000, the default) or as root.")
@click.option("--mlflow-uri-from", type=click.Choice(["configmap", "secret"]),
              help="Where MLFLOW_TRACKING_URI comes from (default configmap).")
@click.option("--controller", type=click.Choice(["gloo", "mpi"]),
              help="How horovodrun runs the ranks: gloo (default; elastic jobs need it) or mpi (OpenMPI).")
@click.option("--api", type=click.Choice(["mpijob", "trainer"]),
              help="mpijob: an MPIJob for the MPI Operator (default; elastic jobs need it); trainer: a Kubeflow "
                   "Trainer v2 TrainJob with the project's own TrainingRuntime.")
@click.option("--checkpoint-size", help="Size of the checkpoint volume claim, 1Gi-64Ti (default 10Gi).")
# Paths are checked by the command itself, so a bad one is one line like every other refusal.
@click.option("--project", type=click.Path(path_type=Path), default=Path("."), show_default=True,
              help="The project folder (holds .hvdgen.yaml).")
@click.option("--check", is_flag=True, help="Validate the manifests in k8s/ (or --file) and change nothing.")
@click.option("--file", "file_", help="With --check: a manifest file to check instead of k8s/; '-' reads stdin.")
def k8s_cmd(project: Path, check: bool, file_: str | None, **answers) -> None:
    """Write the project's Kubernetes manifests (k8s/: an MPIJob, or a Trainer TrainJob), or check them with --check."""
    if check:
        _check(project, file_, answers)
        return
    if file_:
        raise HvdgenError("--file works with --check only: add --check")
    from hvdgen.k8s.layout import options_of
    from hvdgen.k8s.project import regenerate
    from hvdgen.regenerate import load_spec

    opts = options_of(load_spec(project, "hvdgen k8s")).updated(**answers)
    written = [rel for rel in regenerate(project, opts) if rel.startswith("k8s/")]
    click.echo(f"wrote {len(written)} files in {project / 'k8s'} and the k8s answers in .hvdgen.yaml")
    overlays = ["cpu", "gpu"] if opts.gpus_per_worker else ["cpu"]
    click.echo("next: " + "  or  ".join(f"kubectl apply -k {project / 'k8s' / 'overlays' / o}" for o in overlays)
               + f"  (see {project / 'k8s' / 'README.md'})")


def _check(project: Path, file_: str | None, answers: dict) -> None:
    given = sorted(k.replace("_", "-") for k, v in answers.items() if v is not None)
    if given:
        raise HvdgenError(f"--check changes nothing, so --{', --'.join(given)} do not apply: leave them out")
    from hvdgen.k8s.check import check_file, check_project

    problems = check_file(file_) if file_ else check_project(project)
    for problem in problems:
        click.echo(str(problem), err=True)
    if problems:
        raise SystemExit(1)
    click.echo(f"{file_ or project / 'k8s'}: all manifests are valid")

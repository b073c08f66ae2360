"""How a strategy's ranks sit on the worker pods and their GPUs, and which shapes fit.

- data: one rank per GPU (one per worker on CPU);
- model-split: each rank spreads its model's stages over GPUs of its own, one GPU per stage, so a
  worker with G GPUs runs G / stages ranks, and G must be a multiple of the stages (with fewer,
  the stages would fall back to the CPU);
- pipeline: one rank per GPU and one stage (or, with tp, one slice of a stage) per rank; the world
  (workers x slots) must be whole pipelines, a multiple of stages x tp, a GPU worker holds whole
  tp groups, and it cannot be elastic (a lost worker is a lost stage);
- tensor: one rank per GPU; the world must be whole tensor-parallel groups (a multiple of tp), a
  GPU worker holds whole groups (its GPUs a multiple of tp: a group's activations cross it in
  every layer), and it cannot be elastic (a lost worker is a lost slice of every layer).

`slotsPerWorker` is the ranks per worker and `-np` is workers x slots, in every overlay.
"""

from __future__ import annotations

from hvdgen.errors import HvdgenError
from hvdgen.k8s.options import K8sOptions
from hvdgen.spec import ProjectSpec


def slots_per_worker(spec: ProjectSpec, gpus: int) -> int:
    """Horovod ranks per worker pod with `gpus` GPUs (0: the CPU overlay)."""
    if not gpus:
        return 1
    return max(gpus // spec.stages, 1) if spec.strategy == "model-split" else gpus


def default_answers(spec: ProjectSpec) -> dict:
    """The k8s answers that depend on the strategy: one CPU worker per rank of a pipeline (stages x
    tp; with tp, tp GPUs a worker), one GPU per model-split stage, one CPU worker and one GPU per
    rank of a tensor-parallel group."""
    if spec.strategy == "pipeline":  # with tp, a GPU worker holds whole tp groups
        return {"workers": spec.model_ranks} | ({"gpus_per_worker": spec.tp} if spec.tp > 1 else {})
    if spec.strategy == "tensor":
        return {"workers": spec.tp, "gpus_per_worker": spec.tp}
    if spec.strategy == "model-split":
        return {"gpus_per_worker": spec.stages}
    return {}


def overlays(spec: ProjectSpec, opts: K8sOptions) -> list[tuple[str, int]]:
    """(overlay, slots per worker) for each overlay hvdgen writes."""
    out = [("cpu", 1)]
    if opts.gpus_per_worker:
        out.append(("gpu", slots_per_worker(spec, opts.gpus_per_worker)))
    return out


def check_shape(spec: ProjectSpec, opts: K8sOptions) -> None:
    """Refuse, with one line naming the numbers, a job whose ranks do not fit the strategy."""
    if spec.strategy == "model-split":
        _check_model_split(spec, opts)
    elif spec.strategy in ("pipeline", "tensor"):
        _check_whole_groups(spec, opts)


def _check_model_split(spec: ProjectSpec, opts: K8sOptions) -> None:
    stages, gpus = spec.stages, opts.gpus_per_worker
    if gpus % stages:
        ranks = max(gpus // stages, 1)
        raise HvdgenError(f"model-split gives each rank {stages} GPUs of its own (one per stage), so "
                          f"--gpus-per-worker must be {stages} x ranks per worker, got {gpus}: use e.g. "
                          f"--gpus-per-worker {ranks * stages} ({ranks} {'rank' if ranks == 1 else 'ranks'} "
                          "per worker), or 0 for no gpu overlay")


def _check_whole_groups(spec: ProjectSpec, opts: K8sOptions) -> None:
    """A pipeline's world is whole pipelines (stages x tp ranks), a tensor-parallel one whole tp
    groups, each tp group on one worker; neither can be elastic."""
    pipeline = spec.strategy == "pipeline"
    size = spec.model_ranks
    if pipeline:
        groups = f"the pipeline's {spec.stages} stages" + (f" x tp {spec.tp}" if spec.tp > 1 else "")
    else:
        groups = f"tp {spec.tp}"
    if opts.elastic:
        lost = "a stage" if pipeline else "a slice of every layer"
        raise HvdgenError(f"a {spec.strategy} job cannot be elastic (losing a worker loses {lost}): drop --elastic")
    if spec.tp > 1 and opts.gpus_per_worker % spec.tp:
        whole = max(opts.gpus_per_worker // spec.tp, 1) * spec.tp
        raise HvdgenError(f"tensor parallelism keeps each group of tp {spec.tp} ranks on one worker (they exchange "
                          f"activations in every layer), so --gpus-per-worker must be a multiple of {spec.tp}, got "
                          f"{opts.gpus_per_worker}: use e.g. --gpus-per-worker {whole}, or 0 for no gpu overlay")
    for overlay, slots in overlays(spec, opts):
        np = opts.workers * slots
        if np % size:
            fit = next(w for w in range(opts.workers, opts.workers + size + 1) if (w * slots) % size == 0)
            raise HvdgenError(f"the {overlay} job would run -np {np} ({opts.workers} workers x {slots} slots), not a "
                              f"multiple of {groups}: use e.g. --workers {fit}")

"""How a strategy's ranks sit on a Slurm job's nodes, and which shapes fit.

Ranks per node are the GPUs of a node (model-split: GPUs / stages, each rank driving a GPU per
stage), or on CPU nodes `--tasks-per-node`. As on Kubernetes (hvdgen/k8s/ranks.py): a pipeline's or
tensor-parallel job's world is whole copies of the model (stages x tp ranks), a tensor-parallel
group never spans nodes (its ranks exchange activations in every layer), and neither can be
elastic. An elastic job runs on Gloo: horovodrun's elastic mode has no MPI launch.
"""

from __future__ import annotations

from math import gcd

from hvdgen.errors import HvdgenError
from hvdgen.k8s.launch import START_TIMEOUT_S
from hvdgen.k8s.ranks import slots_per_worker
from hvdgen.slurm.options import SlurmOptions
from hvdgen.spec import ProjectSpec


def default_answers(spec: ProjectSpec) -> dict:
    """The GPUs of the node the project's README trains on: 4 ranks' worth (model-split: a GPU per
    stage of each rank; tensor: whole tp groups, at least one)."""
    if spec.strategy == "tensor":
        return {"gpus_per_node": spec.tp * max(1, 4 // spec.tp)}
    return {"gpus_per_node": spec.ranks_per_gpu_node * (spec.stages if spec.strategy == "model-split" else 1)}


def options_of(spec: ProjectSpec) -> SlurmOptions:
    """The recorded slurm answers over the strategy's defaults (SlurmOptions checks each of them)."""
    return SlurmOptions.from_answers({**default_answers(spec), **spec.slurm})


def ranks_per_node(spec: ProjectSpec, opts: SlurmOptions) -> int:
    if opts.gpus_per_node:
        return slots_per_worker(spec, opts.gpus_per_node)
    return opts.tasks_per_node or spec.tp


def check_shape(spec: ProjectSpec, opts: SlurmOptions) -> None:
    """Refuse, with one line naming the numbers, a job whose ranks do not fit the strategy."""
    if spec.elastic and opts.controller == "mpi":
        raise HvdgenError("elastic Horovod runs on Gloo only (horovodrun's elastic mode has no MPI launch): use "
                          "--controller gloo, or a project made without --elastic for an MPI job")
    gpus = opts.gpus_per_node
    if spec.strategy == "model-split" and gpus % spec.stages:
        ranks = max(gpus // spec.stages, 1)
        raise HvdgenError(f"model-split gives each rank {spec.stages} GPUs of its own (one per stage), so "
                          f"--gpus-per-node must be {spec.stages} x ranks per node, got {gpus}: use e.g. "
                          f"--gpus-per-node {ranks * spec.stages}")
    per_node = ranks_per_node(spec, opts)
    what = f"--gpus-per-node {gpus}" if gpus else f"--tasks-per-node {per_node}"
    if spec.tp > 1 and per_node % spec.tp:
        whole = max(per_node // spec.tp, 1) * spec.tp
        flag = "--gpus-per-node" if gpus else "--tasks-per-node"
        raise HvdgenError(f"tensor parallelism keeps each group of tp {spec.tp} ranks on one node (they exchange "
                          f"activations in every layer), so {what} must be a multiple of {spec.tp}: use e.g. "
                          f"{flag} {whole}")
    size = spec.model_ranks
    world = opts.nodes * per_node
    if world % size:
        step = size // gcd(size, per_node)
        fit = (opts.nodes // step + 1) * step
        groups = (f"the pipeline's {spec.stages} stages" + (f" x tp {spec.tp}" if spec.tp > 1 else "")
                  if spec.strategy == "pipeline" else f"tp {spec.tp}")
        raise HvdgenError(f"--nodes {opts.nodes} x {per_node} ranks per node ({what}) is {world} ranks, not a "
                          f"multiple of {groups}: use e.g. --nodes {fit}")


def script_context(spec: ProjectSpec) -> dict:
    """What slurm/train.sbatch is rendered from; refuses (HvdgenError) a shape that does not fit."""
    opts = options_of(spec)
    check_shape(spec, opts)
    per_node = ranks_per_node(spec, opts)
    return {"opts": opts, "ranks_per_node": per_node, "world": opts.nodes * per_node,
            "start_timeout_s": START_TIMEOUT_S}  # horovodrun's probe of the nodes, as on Kubernetes

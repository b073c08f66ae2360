"""parallelize: the one place a strategy is applied to the user's model, from outside, for PyTorch.

    model = build_model(cfg.model, dataset.input_shape, dataset.num_classes)   # model.py: no Horovod
    parallel = parallelize(model, ctx, cfg, dataset, steps_per_epoch=len(train_batches))
    train_epoch(parallel.step, ...)                                            # hvd_runtime.loop
    save_checkpoint(checkpoints, parallel, state, ctx)               # hvd_runtime.torch.checkpoint

As torchtitan's `parallelize_llama` does, it applies the parallelisms in order, each a small
function with explicit arguments, so that a strategy is a path through them, not a copy of train.py:

    apply_tp             tensor: the blocks, token embedding and head split over the tp group
    apply_pipeline       pipeline: this rank's stage of the model, then its slices of it (tp)
    apply_model_split    model-split: the model's blocks over this rank's devices
    recompute_blocks     model.recompute: blocks: each block's activations recomputed in backward
    shard_parameters     horovod.zero 3: each replica holds its rows of every parameter (of its
                         slice under tensor parallelism)
    apply_data_parallel  the Horovod optimizer averaging gradients over the replicas (the dp set),
                         or ZeRO's sharding them (horovod.zero), the LR scaled by their number,
                         and the step the loop drives; a pipeline's step is its engine, which
                         averages each stage over its replicas

The rank grid comes from the Context (`ctx.tensor`, `ctx.pipeline`: hvd_runtime.parallel.dims),
made at start-up; the loss and accuracy are the model's plain ones, or the vocabulary-parallel
ones where tensor parallelism leaves the logits split (hvd_runtime.torch.vocab_parallel).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from hvd_runtime.config import partition_spec
from hvd_runtime.nonfinite import nonfinite_guard
from hvd_runtime.pipeline.checkpoint import partition_to_resume
from hvd_runtime.pipeline.grid import PipelineRank
from hvd_runtime.pipeline.partition import Partition
from hvd_runtime.torch.checkpoint import newest_cut
from hvd_runtime.torch.compile import compile_model, wanted
from hvd_runtime.torch.context import Context
from hvd_runtime.torch.memory_plan import activations_of, pipeline_in_flight, plan_and_check
from hvd_runtime.torch.meta_init import is_meta, materialize, whole
from hvd_runtime.torch.model_split import ModelSplit
from hvd_runtime.torch.optim import make_optimizer, make_schedule, plain_optimizer
from hvd_runtime.torch.pipeline import PipelineEngine, build_stage, slice_stage
from hvd_runtime.torch.precision import Precision
from hvd_runtime.torch.recompute import recompute_blocks
from hvd_runtime.torch.stage import named_blocks, plan_timed_on_rank0
from hvd_runtime.torch.step import TrainStep
from hvd_runtime.torch.sync_batchnorm import use_sync_batchnorm
from hvd_runtime.torch.tensor_parallel import apply_tp
from hvd_runtime.torch.tensor_state import SlicedParameters
from hvd_runtime.torch.vocab_parallel import VocabObjective
from hvd_runtime.torch.zero import ZeroOptimizer, shard_parameters
from hvd_runtime.zero_rows import refuse_misfits

__all__ = ["Parallel", "apply_data_parallel", "apply_model_split", "apply_pipeline", "apply_tp",
           "parallelize"]


@dataclass
class Parallel:
    """What parallelize made of the model on this rank."""

    module: nn.Module                        # what this rank trains and checkpoints: the model (sliced under tp), its ModelSplit or its stage
    optimizer: torch.optim.Optimizer
    step: TrainStep | PipelineEngine         # what hvd_runtime.loop drives
    slices: SlicedParameters | None = None   # tensor parallelism: the checkpoints' view of the slices
    plan: Partition | None = None            # where a pipeline or model-split cut the model, for the index


def apply_pipeline(model: nn.Module, place: PipelineRank, partition, sample: torch.Tensor, tail=None) -> nn.Module:
    """This rank's stage of the unchanged model, split over its tensor-parallel group (if any).

    `partition`: as config.partition_spec gives it; `sample` (a micro-batch) and `tail` (the last
    stage's loss and metrics) are what `time` times."""
    stage = build_stage(model, place, partition=partition, sample=sample, tail=tail)
    return slice_stage(stage, place)


def batch_sample(dataset, cfg) -> torch.Tensor:
    """A rank's training batch of inputs on the meta device (one example read for its shape and
    dtype): what the memory plan measures a step's activations on."""
    x = torch.from_numpy(dataset.train.examples(1)[0])
    return torch.empty((cfg.train.batch_size, *x.shape[1:]), dtype=x.dtype, device="meta")


def timing_sample(dataset, cfg) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """What `partition: time` times the blocks on: a micro-batch of the training set (stages run
    micro-batches, where a call's fixed cost weighs most), and the tail the last stage adds, the
    metrics and the loss on its targets (the whole model's output: timing precedes any slices)."""
    micro_batch = max(1, cfg.train.batch_size // cfg.parallel.micro_batches)
    x, y = (torch.from_numpy(a) for a in dataset.train.examples(micro_batch))
    objective = VocabObjective.of(None, dataset.num_classes)

    def tail(out: torch.Tensor) -> torch.Tensor:
        objective.accuracy(out.detach(), y)
        return objective.cross_entropy(out, y)
    return x, tail


def apply_model_split(model: nn.Module, parallel_cfg, partition, sample: torch.Tensor | None = None,
                      tail=None) -> ModelSplit:
    """The model's blocks over this rank's devices (its GPUs, or the CPU), micro-batched.
    `partition`: resumed_partition's; `sample` and `tail` as apply_pipeline's."""
    if partition == "time":
        # the parameters' names (which the allreduce pairs up across workers) follow the cut:
        # every worker cuts where rank 0 does
        partition = plan_timed_on_rank0(model, parallel_cfg.stages, sample, tail, "ms.partition")
    return ModelSplit(model, stages=parallel_cfg.stages, partition=partition, micro_batches=parallel_cfg.micro_batches)


def apply_data_parallel(module: nn.Module, ctx: Context, cfg, objective: VocabObjective, steps_per_epoch: int,
                        slices: SlicedParameters | None = None) -> tuple[torch.optim.Optimizer, TrainStep]:
    """Horovod's DistributedOptimizer over the replicas (ctx.dp_set), or ZeRO's (horovod.zero), LR
    scaled by their number with warmup, and the TrainStep: fp16 loss scaling and clipping (by the
    whole model's norm: `slices`'s under tensor parallelism, the rows' summed under ZeRO) wait for
    the averaged gradients."""
    optimizer, schedule = make_optimizer(module, cfg.optim, cfg.horovod, ctx, steps_per_epoch, slices)
    norm = optimizer.grad_norm if isinstance(optimizer, ZeroOptimizer) else slices.grad_norm if slices else None
    precision = Precision(cfg.train.precision, ctx.device, cfg.optim.clip_norm, norm)
    step = TrainStep(module, optimizer, schedule, objective.cross_entropy, ctx, cfg.horovod.backward_passes_per_step,
                     precision, accuracy_fn=objective.accuracy_sum, guard=nonfinite_guard(cfg, ctx))
    return optimizer, step


def apply_compile(model: nn.Module, ctx: Context, cfg, dataset, objective: VocabObjective) -> bool:
    """train.compile: `model` compiled in place (hvd_runtime.torch.compile), warmed up on a training
    batch's shape under the run's precision; whether it runs compiled."""
    import horovod.torch as hvd

    x, y = (torch.from_numpy(a).to(ctx.device) for a in dataset.train.examples(cfg.train.batch_size))
    precision = Precision(cfg.train.precision, ctx.device)

    def warm_up(module: nn.Module) -> torch.Tensor:
        module.train()
        with precision.autocast():
            out = module(x)
            return objective.cross_entropy(out, y.to(out.device))
    if os.environ.get("HOROVOD_ELASTIC") == "1":   # a worker joining later starts outside the others' collectives
        return compile_model(model, warm_up, lambda problem: [problem], ctx.is_root)
    return compile_model(model, warm_up, lambda problem: hvd.allgather_object(problem, name="compile.verdict"),
                         ctx.is_root)


def refuse_zero_misfits(cfg, ctx: Context) -> None:
    """horovod.zero with what it cannot serve: one line each (ConfigError), before anything is made."""
    hvd = cfg.horovod
    refuse_misfits(hvd, [
        (ctx.pipeline is not None and hvd.zero > 1, "pipeline stages (every micro-batch's backward would "
                                                   "reduce-scatter again): use horovod.zero 1"),
        (ctx.pipeline is not None and ctx.pipeline.dims.tp > 1,
         "a pipeline's tensor parallelism (parallel.tp): use horovod.zero 0 there, or parallel.tp 1"),
        (ctx.stage_devices is not None, "model-split: use --strategy data"),
    ])


def resumed_partition(model, pieces: int, ctx: Context, cfg):
    """cfg.parallel.partition for a cut into `pieces`; `time` resumes at the newest checkpoint's cut
    (partition_to_resume), for a pipeline's stages and a model-split's alike."""
    return partition_to_resume(partition_spec(cfg.parallel.partition), [name for name, _ in named_blocks(model)],
                               pieces, lambda: newest_cut(cfg.checkpoint, ctx))


def _pipeline(model: nn.Module, ctx: Context, cfg, dataset, steps_per_epoch: int) -> Parallel:
    """This rank's stage, its optimizer (LR scaled by the replicas: stages add no samples) and its
    engine, which walks the schedule, averages the stage's gradients over its replicas and clips
    by the whole model's norm, summed over the stages."""
    wanted(cfg.train.compile, ctx.device, pipeline=True)   # refuses `on`: a stage runs eager
    place = ctx.pipeline
    partition = resumed_partition(model, place.stages * place.chunks, ctx, cfg)
    sample, tail = timing_sample(dataset, cfg)
    per_block = activations_of(model, sample)   # before tp splits the blocks: a micro-batch's
    # The model is on the meta device: this rank draws only its stage (its slices under tp), from
    # the seed and each tensor's name in the whole model, so each stage starts from the same model
    # wherever the stages cut (`partition: time` may cut differently from one start to the next).
    meta = is_meta(model)   # the whole model's: a stage may hold no parameter
    stage = apply_pipeline(model, place, partition, sample, tail)
    plan_and_check(stage, per_block, ctx, cfg, "more parallel.stages, or a larger parallel.tp for a GPT",
                   blocks=[name for names in stage.chunk_names for name in names],
                   scale=pipeline_in_flight(cfg, place) / place.dims.tp, recompute_scale=1 / place.dims.tp, meta=meta)
    stage = materialize(stage, cfg.seed, ctx.device).to(ctx.device)
    objective = VocabObjective.of(place.tensor_group, dataset.num_classes)
    schedule = make_schedule(cfg.optim, cfg.horovod, steps_per_epoch)
    lr = schedule.lr(0, ctx.data_size)
    if cfg.horovod.zero and ctx.dp_set is not None:
        # Horovod: the engine reduce-scatters the stage's gradients over its replicas, each steps its rows
        optimizer = ZeroOptimizer(stage, lambda tensors: plain_optimizer(tensors, cfg.optim, lr), cfg.horovod.zero,
                                  ctx.dp_set, ctx.data_rank, ctx.data_size)
    else:        # a lone replica: nothing to shard
        optimizer = plain_optimizer(stage.parameters(), cfg.optim, lr)
    engine = PipelineEngine(stage, place, objective.cross_entropy, optimizer, schedule=cfg.parallel.schedule,
                            micro_batches=cfg.parallel.micro_batches, metrics_fn=objective.accuracy, timeline=True,
                            precision=cfg.train.precision, clip_norm=cfg.optim.clip_norm, lr_schedule=schedule,
                            guard=nonfinite_guard(cfg, ctx))
    return Parallel(stage, optimizer, engine, SlicedParameters(stage) if place.tensor_group else None, stage.plan)


def _recompute(model: nn.Module, cfg) -> None:
    """model.recompute: blocks: each block keeps only its input for backward (hvd_runtime.torch.recompute)."""
    if cfg.model.recompute == "blocks":
        recompute_blocks(model)


def parallelize(model: nn.Module, ctx: Context, cfg, dataset, steps_per_epoch: int) -> Parallel:
    """Apply to `model` the parallelism `ctx` was started with, as cfg.parallel and cfg.horovod say:
    a pipeline rank (ctx.pipeline) its stage, a tensor-parallel one (ctx.tensor) its slices, one
    that drives several devices (ctx.stage_devices) the model split over them, any other the whole
    model, data parallel.

    `model`: as hvd_runtime.torch.meta_init.build_on_meta builds it, on the meta device; a
    pipeline or tensor-parallel rank makes real only its stage or slices, each tensor drawn from
    cfg.seed and its name in the whole model, so every cut and tp starts from the same model; the
    whole model (data, model-split) is built for real under cfg.seed; a model built for real is
    used as it is. `dataset`: its vocabulary (num_classes) for a split head's loss, and a
    pipeline's sample batch, whose shapes decide where the stages cut. model.py is never edited:
    every piece is applied from outside.
    """
    # Recomputed blocks (a class swap: a stage, tp's copies and split layers keep it) on the meta model
    # already, so the memory plan counts what they keep; a stage recomputes in each micro-batch's backward.
    _recompute(model, cfg)
    zero = cfg.horovod.zero
    if zero:
        refuse_zero_misfits(cfg, ctx)
    if ctx.pipeline is not None:
        return _pipeline(model, ctx, cfg, dataset, steps_per_epoch)
    tensor = ctx.tensor is not None
    per_block = activations_of(model, batch_sample(dataset, cfg))
    if tensor:   # this rank draws only its slices (and the tensors kept whole; ZeRO 3: its rows of each)
        model = apply_tp(model, ctx.tensor.group)
        shards = "horovod.zero 3 (each replica holds 1/replicas of its slices), " if zero < 3 and \
            ctx.data_size > 1 else ""
        plan_and_check(model, per_block, ctx, cfg, f"{shards}a larger parallel.tp", scale=1 / ctx.tensor.group.size)
        if zero == 3 and ctx.dp_set is not None:   # each slice cut where tensor parallelism cut it
            cut_dims = {name: cut.dim for name, cut in SlicedParameters(model).by_name.items()}
            model = shard_parameters(model, ctx.dp_set, ctx.data_rank, ctx.data_size, cut_dims)
        model = materialize(model, cfg.seed, ctx.device)
    else:        # every rank holds the whole model (ZeRO 3: its rows of each parameter)
        shards = "horovod.zero 3 (each replica holds 1/replicas of the model), " if zero < 3 and \
            ctx.data_size > 1 and ctx.stage_devices is None else ""
        plan_and_check(model, per_block, ctx, cfg, f"{shards}a project that splits the model (hvdgen new --strategy "
                                                   "pipeline or tensor)")
        if zero == 3:   # drawn from the recipes, a rank its rows only, so any layout starts from one model
            model = materialize(shard_parameters(model, ctx.dp_set, ctx.data_rank, ctx.data_size), cfg.seed,
                                ctx.device)
        else:           # built for real, under the seed
            model = whole(model, cfg.seed)
    if cfg.horovod.sync_batchnorm:
        model = use_sync_batchnorm(model)  # BatchNorm statistics over the global batch
    _recompute(model, cfg)   # whole() built the model again
    if ctx.stage_devices is not None:
        # it places each block on its own device
        model = apply_model_split(model, cfg.parallel, resumed_partition(model, cfg.parallel.stages, ctx, cfg),
                                    *timing_sample(dataset, cfg))
    else:
        model = model.to(ctx.device)
    slices = SlicedParameters(model) if tensor else None
    objective = VocabObjective.of(ctx.tensor.group if slices else None, dataset.num_classes)
    # before the optimizer's gradient hooks: a warm-up step of its own
    if wanted(cfg.train.compile, ctx.device, zero3=zero == 3):
        apply_compile(model, ctx, cfg, dataset, objective)
    optimizer, step = apply_data_parallel(model, ctx, cfg, objective, steps_per_epoch, slices)
    return Parallel(model, optimizer, step, slices, model.plan if isinstance(model, ModelSplit) else None)

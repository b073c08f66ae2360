"""parallelize: the one place a strategy is applied to the user's model, from outside, for Keras 3.

The TensorFlow side of `hvd_runtime.torch.parallelize`, with the same signature, the same
`Parallel` and the same order of small steps (see there):

    apply_tp             tensor: a Sequential of the model's layers, blocks, embedding and head split
    apply_pipeline       pipeline: this rank's stage of the model, then its slices of it (tp)
    apply_model_split    model-split: the model's layers over this rank's devices
    recompute_blocks     model.recompute: blocks: each block's activations recomputed in backward
    apply_data_parallel  the optimizer (LR scaled by the replicas, with warmup; fp16 loss scaling),
                         the gradient allreduce over the replicas (the dp set), and the TrainStep;
                         a pipeline's step is its engine

Precision is set before the model is built (`use_precision`), so it stays in train.py.
`Parallel.module` is what the checkpoints hold: the model (a model-split's split shares its
variables), the split model, or the stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import keras
import tensorflow as tf

from hvd_runtime.config import ConfigError, partition_spec
from hvd_runtime.nonfinite import nonfinite_guard
from hvd_runtime.pipeline.checkpoint import partition_to_resume
from hvd_runtime.pipeline.grid import PipelineRank
from hvd_runtime.pipeline.partition import Partition
from hvd_runtime.tf.context import Context
from hvd_runtime.tf.gradients import GradientSync
from hvd_runtime.tf.memory_plan import plan_and_check
from hvd_runtime.tf.meta_init import is_meta, materialize, whole
from hvd_runtime.tf.model_split import ModelSplit
from hvd_runtime.tf.names import is_state
from hvd_runtime.tf.optim import make_optimizer
from hvd_runtime.tf.pipeline import PipelineEngine, Stage, build_stage, replica_context, slice_stage
from hvd_runtime.tf.checkpoint import newest_cut
from hvd_runtime.tf.precision import loss_scaled
from hvd_runtime.tf.recompute import recompute_blocks
from hvd_runtime.tf.stage import named_blocks, plan_timed_on_rank0
from hvd_runtime.tf.step import TrainStep
from hvd_runtime.tf.sync_batchnorm import use_sync_batchnorm
from hvd_runtime.tf.tensor_parallel import apply_tp
from hvd_runtime.tf.tensor_state import SlicedVariables
from hvd_runtime.tf.vocab_parallel import VocabObjective
from hvd_runtime.tf.zero import ZeroSync
from hvd_runtime.zero_rows import refuse_misfits

__all__ = ["Parallel", "apply_data_parallel", "apply_model_split", "apply_pipeline", "apply_tp",
           "parallelize"]


@dataclass
class Parallel:
    """What parallelize made of the model on this rank."""

    module: keras.Model | Stage              # what this rank checkpoints: the model, the sliced model or the stage
    optimizer: keras.optimizers.Optimizer
    step: TrainStep | PipelineEngine         # what hvd_runtime.loop drives
    slices: SlicedVariables | None = None    # tensor parallelism: the checkpoints' view of the slices
    plan: Partition | None = None            # where a pipeline or model-split cut the model, for the index
    zero: ZeroSync | None = None             # horovod.zero: the rows this rank steps, for the checkpoints


def apply_pipeline(model: keras.Model, place: PipelineRank, partition, sample, tail=None) -> Stage:
    """This rank's stage of the unchanged model, split over its tensor-parallel group (if any).

    `partition`: as config.partition_spec gives it; `sample` (a micro-batch) and `tail` (the last
    stage's loss and metrics) are what `time` times."""
    stage = build_stage(model, place, partition=partition, sample=sample, tail=tail)
    return slice_stage(stage, place)


def timing_sample(dataset, cfg) -> tuple:
    """What `partition: time` times the layers on: a micro-batch of the training set (stages run
    micro-batches, where a call's fixed cost weighs most), and the tail the last stage adds, the
    metrics and the loss on its targets (the whole model's output: timing precedes any slices)."""
    x, y = dataset.train.examples(max(1, cfg.train.batch_size // cfg.parallel.micro_batches))
    objective, targets = VocabObjective.of(None, dataset.num_classes), tf.convert_to_tensor(y)

    def tail(out):
        objective.accuracy(tf.stop_gradient(out), targets)
        return objective.cross_entropy(targets, out)
    return x, tail


def apply_model_split(model: keras.Model, parallel_cfg, partition, sample=None, tail=None) -> ModelSplit:
    """The model's layers over this rank's devices (its GPUs, or logical CPU devices), micro-batched;
    the split shares the model's variables. `partition`: resumed_partition's; `sample` and `tail`
    as apply_pipeline's."""
    if partition == "time":  # every worker cuts where rank 0 does: one model layout
        partition = plan_timed_on_rank0(model, parallel_cfg.stages, sample, tail, "ms.partition")
    return ModelSplit(model, stages=parallel_cfg.stages, partition=partition, micro_batches=parallel_cfg.micro_batches)


def apply_data_parallel(trained, ctx: Context, cfg, objective: VocabObjective, steps_per_epoch: int,
                        slices: SlicedVariables | None = None
                        ) -> tuple[keras.optimizers.Optimizer, TrainStep, ZeroSync | None]:
    """The optimizer (LR scaled by the replicas, with warmup), the gradient allreduce between backward
    and update (over the replicas holding the same slices, under tensor parallelism), or ZeRO's
    reduce-scatter into this rank's rows (horovod.zero), and the TrainStep. A split model and ZeRO's
    rows are clipped by the step, by the whole model's norm (`slices`'s, the rows' summed);
    otherwise the optimizer clips the averaged gradients itself."""
    zero = None
    if cfg.horovod.zero:
        # Horovod: gradients reduce-scattered over the replicas, each rank steps its rows, rows all-gathered
        zero = ZeroSync(trained.trainable_variables, cfg.horovod.zero, ctx.dp_set, ctx.data_rank, ctx.data_size,
                        ctx.device)
    optimizer = loss_scaled(make_optimizer(cfg.optim, cfg.horovod, ctx, steps_per_epoch,
                                           clip=slices is None and zero is None), cfg.train.precision)
    sync = zero or (GradientSync(cfg.horovod.fp16_compression, cfg.horovod.adasum) if slices is None else
                    GradientSync(cfg.horovod.fp16_compression, cfg.horovod.adasum, process_set=ctx.dp_set))
    norm = zero.grad_norm if zero else slices.grad_norm if slices else None
    step = TrainStep(trained, optimizer, objective.cross_entropy, sync, cfg.horovod.backward_passes_per_step,
                     clip_norm=cfg.optim.clip_norm, grad_norm=norm, accuracy_fn=objective.accuracy_sum,
                     guard=nonfinite_guard(cfg, ctx))
    return optimizer, step, zero


def refuse_zero_misfits(cfg, ctx: Context) -> None:
    """horovod.zero with what a Keras project cannot serve with it: one line each (ConfigError)."""
    hvd = cfg.horovod
    refuse_misfits(hvd, [
        (hvd.zero > 2, "a Keras project (its layers hold whole variables): use horovod.zero 1 or 2, or a torch "
                       "project"),
        (ctx.pipeline is not None or ctx.tensor is not None or ctx.stage_devices is not None,
         "a Keras pipeline, tensor-parallel or model-split project: use horovod.zero 0 there, or --strategy data"),
        (cfg.train.precision == "fp16", "train.precision fp16 in Keras (each rank's loss scale would judge only its "
                                        "rows): use bf16"),
    ])


def resumed_partition(model, pieces: int, ctx: Context, cfg):
    """cfg.parallel.partition for a cut into `pieces`; `time` resumes at the newest checkpoint's cut
    (partition_to_resume), for a pipeline's stages and a model-split's alike."""
    return partition_to_resume(partition_spec(cfg.parallel.partition), [name for name, _ in named_blocks(model)],
                               pieces, lambda: newest_cut(cfg.checkpoint, ctx))


def _pipeline(model: keras.Model, ctx: Context, cfg, dataset, steps_per_epoch: int) -> Parallel:
    """This rank's stage, its optimizer (LR scaled by the replicas: stages add no samples) and its
    engine, which walks the schedule, averages the stage's gradients over its replicas and clips
    by the whole model's norm, summed over the stages."""
    import horovod.tensorflow as hvd

    place = ctx.pipeline
    # The model has no values yet (hvd_runtime.tf.meta_init): this rank draws only its stage (its
    # slices under tp), from the seed and each variable's name in the whole model, so each stage
    # starts from the same model wherever the stages cut (`partition: time` may cut differently
    # from one start to the next). A model built for real is every rank's own: rank 0's goes to all.
    meta = is_meta(model)   # the whole model's: a stage may hold no variable
    if not meta:
        hvd.broadcast_variables([v.value for v in model.variables if is_state(v)], root_rank=0)
    partition = resumed_partition(model, place.stages * place.chunks, ctx, cfg)
    stage = apply_pipeline(model, place, partition, *timing_sample(dataset, cfg))
    plan_and_check(stage, ctx, cfg, "more parallel.stages, or a larger parallel.tp for a GPT", meta=meta)
    stage = materialize(stage, cfg.seed)
    _recompute(stage, cfg)  # in each micro-batch's backward
    objective = VocabObjective.of(place.tensor_group, dataset.num_classes)
    optimizer = make_optimizer(cfg.optim, cfg.horovod, replica_context(ctx, place), steps_per_epoch, clip=False)
    engine = PipelineEngine(stage, place, objective.cross_entropy, optimizer, schedule=cfg.parallel.schedule,
                            micro_batches=cfg.parallel.micro_batches, metrics_fn=objective.accuracy, timeline=True,
                            clip_norm=cfg.optim.clip_norm, guard=nonfinite_guard(cfg, ctx))
    return Parallel(stage, optimizer, engine, SlicedVariables(stage) if place.tensor_group else None, stage.plan)


def _recompute(model, cfg) -> None:
    """model.recompute: blocks: each block keeps only its input for backward (hvd_runtime.tf.recompute)."""
    if cfg.model.recompute == "blocks":
        recompute_blocks(model)


def parallelize(model: keras.Model, ctx: Context, cfg, dataset, steps_per_epoch: int) -> Parallel:
    """Apply to `model` the parallelism `ctx` was started with, as cfg.parallel and cfg.horovod say:
    a pipeline rank (ctx.pipeline) its stage, a tensor-parallel one (ctx.tensor) its slices, one
    that drives several devices (ctx.stage_devices) the model split over them, any other the whole
    model, data parallel.

    `model`: as hvd_runtime.tf.meta_init.build_on_meta builds it, without values; a pipeline or
    tensor-parallel rank makes real only its stage or slices, each variable drawn from cfg.seed and
    its name in the whole model, so every cut and tp starts from the same model; the whole model
    (data, model-split, elastic) takes its own initializers' values; a model built for real is used
    as it is. `dataset`: its vocabulary (num_classes) for a split head's loss, and a pipeline's
    sample batch, whose shapes decide where the stages cut. model.py is never edited.
    """
    if cfg.train.compile == "on":
        raise ConfigError("train.compile on compiles torch models (torch.compile): a Keras project's step runs as "
                          "a traced tf.function; set train.compile auto or off")
    if cfg.horovod.zero:
        refuse_zero_misfits(cfg, ctx)
    if ctx.pipeline is not None:
        return _pipeline(model, ctx, cfg, dataset, steps_per_epoch)
    group, slices = None, None
    if ctx.tensor is not None:   # this rank draws only its slices (and the variables kept whole)
        import horovod.tensorflow as hvd

        if not is_meta(model):   # built for real under each rank's seed: the slices come from rank 0's
            hvd.broadcast_variables([v.value for v in model.variables if is_state(v)], root_rank=0)
        group = ctx.tensor.group
        model = apply_tp(model, group)
        plan_and_check(model, ctx, cfg, "a larger parallel.tp")
        model = materialize(model, cfg.seed)
        slices = SlicedVariables(model)
    else:                        # every rank holds the whole model: its own initializers' values
        plan_and_check(model, ctx, cfg, "a project that splits the model (hvdgen new --strategy pipeline or tensor)")
        model = whole(model)
    if cfg.horovod.sync_batchnorm:
        model = use_sync_batchnorm(model)  # BatchNorm statistics over the global batch
    _recompute(model, cfg)
    trained = model
    if ctx.stage_devices is not None:
        trained = apply_model_split(model, cfg.parallel, resumed_partition(model, cfg.parallel.stages, ctx, cfg),
                                    *timing_sample(dataset, cfg))
    objective = VocabObjective.of(group, dataset.num_classes)
    optimizer, step, zero = apply_data_parallel(trained, ctx, cfg, objective, steps_per_epoch, slices)
    return Parallel(model, optimizer, step, slices, trained.plan if trained is not model else None, zero)

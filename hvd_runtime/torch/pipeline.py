"""Pipeline-parallel training over Horovod: stages on ranks, micro-batches, dp replicas per stage.

    import horovod.torch as hvd
    from hvd_runtime.torch.pipeline import PipelineEngine, build_stage, init_pipeline

    ctx, place = init_pipeline(stages=2)                  # Horovod: init with the pipeline's process sets
    stage = build_stage(model, place, partition="params")  # this rank's blocks of the unchanged model
    engine = PipelineEngine(stage, place, loss_fn=F.cross_entropy, optimizer=torch.optim.SGD(stage.parameters(), 0.1),
                            schedule="1f1b", micro_batches=4)
    loss, metrics = engine.train_step(x, y)              # same numbers on every rank
    loss, metrics = engine.evaluate(val_batches)
    engine.save_timeline(run_dir)                        # rank 0 writes timeline.json

Data: shard by replica (`num_replicas=place.replicas, rank=place.replica`); every stage of a replica
walks the same batches. The first stage reads x, the last y; a middle stage may pass only
`batch_size=` (it needs the micro-batch sizes). `loss_fn` must return the mean over its
micro-batch: the engine weights micro-batches by size, so a step's loss and gradients are those
of the whole batch, averaged over the dp replicas by Horovod in the stage's process set.
"""

from __future__ import annotations

import contextlib
import math

import torch

from hvd_runtime.config import ConfigError
from hvd_runtime.nonfinite import Guard
from hvd_runtime.pipeline.engine import PipelineEngineBase
from hvd_runtime.pipeline.grid import micro_batch_sizes
from hvd_runtime.pipeline.schedule import SPLIT_BACKWARD
from hvd_runtime.pipeline.grid import chunks_per_rank
from hvd_runtime.torch.grid import ParallelDims, PipelineConfigError, PipelineRank, init_pipeline
from hvd_runtime.torch.meta_init import is_meta
from hvd_runtime.torch.precision import Precision, poisoned
from hvd_runtime.torch.split_backward import SplitBackward, WeightWork
from hvd_runtime.torch.stage import build_stage, plan_stages
from hvd_runtime.torch.tensor_parallel import slice_model
from hvd_runtime.torch.tensor_state import SlicedParameters
from hvd_runtime.torch.zero import ZeroOptimizer

__all__ = ["ParallelDims", "PipelineConfigError", "PipelineEngine", "PipelineRank", "build_stage", "chunks_per_rank",
           "init_pipeline",
           "micro_batch_sizes", "plan_stages", "slice_stage"]


def slice_stage(stage: torch.nn.Module, place: PipelineRank) -> torch.nn.Module:
    """The stage with its transformer blocks, token embedding and head split over its tensor-parallel
    group (init_pipeline's tp; the last stage's logits are then split over the vocabulary).

    A stage on the meta device (hvd_runtime.torch.meta_init) splits into meta slices, which every
    rank draws from the same recipes: one model for the group without a message. A real stage was
    built under each rank's own seed: every rank of the group first takes its first rank's weights,
    so that the slices come from one model and the parameters kept whole (LayerNorm, position
    embeddings) are the same on all. Unchanged at tp 1.
    """
    group = place.tensor_group
    if group is None:
        return stage
    if not is_meta(stage):
        # Horovod: one model for the whole group, from its first rank
        _broadcast_state(stage, place.dims.tp_ranks(place.rank)[0], group.process_set, "tp.init")
    return slice_model(stage, group)


def _broadcast_state(module: torch.nn.Module, root: int, process_set, prefix: str) -> None:
    """Every tensor of the module's state from global rank `root` to the ranks of `process_set`, in place.

    Horovod's broadcast_parameters takes no process set; this is it for one.
    """
    import horovod.torch as hvd

    handles = [hvd.broadcast_async_(t.data, root, name=f"{prefix}.{name}", process_set=process_set)
               for name, t in module.state_dict().items()]
    for handle in handles:
        hvd.synchronize(handle)


class PipelineEngine(PipelineEngineBase):
    """Runs one stage's part of the schedule each step, then averages its gradients over dp."""

    def __init__(self, stage: torch.nn.Module, place: PipelineRank, loss_fn, optimizer, schedule: str = "1f1b",
                 micro_batches: int = 4, metrics_fn=None, timeline: bool = False, timeline_steps: int = 20,
                 device=None, precision: str = "fp32", clip_norm: float = 0.0, lr_schedule=None,
                 guard: Guard | None = None):
        import horovod.torch as hvd

        super().__init__(hvd, place, schedule, micro_batches, metrics_fn, timeline, timeline_steps, guard)
        self.stage, self.loss_fn, self.optimizer = stage, loss_fn, optimizer
        self.device = torch.device(device) if device else next(stage.parameters(), torch.empty(0)).device
        if precision == "fp16":  # one loss scale would have to be agreed by every stage, every step
            raise ConfigError("train.precision fp16 is not offered for the pipeline strategy: use bf16 (no loss "
                              "scaling needed) or fp32")
        self._autocast = Precision(precision, self.device).autocast
        self.clip_norm, self.lr_schedule = clip_norm, lr_schedule
        # Tensor-parallel stages: the parameters held as slices, found once (the clip norm counts them apart)
        self._split_ids = set(SlicedParameters(stage).by_param) if place.dims.tp > 1 else set()
        self.sharded = isinstance(optimizer, ZeroOptimizer)   # horovod.zero 1: the replicas' rows
        self._saved: dict[tuple, tuple] = {}   # (chunk, micro-batch) -> (input, output to backpropagate, module calls)
        self.split_backward = SplitBackward(stage) if schedule in SPLIT_BACKWARD else None
        self._weight_work: dict[tuple, object] = {}   # zero-bubble: (chunk, micro-batch) -> its weight gradients, still to do
        self.linears_batched = 0   # the last step's Linear calls whose weight gradients went as one product
        self._sync_replicas()

    def _sync_replicas(self) -> None:
        """Start every replica of this stage from replica 0's parameters and buffers."""
        if self.place.dp_set is not None:
            _broadcast_state(self.stage, self.place.stage_root, self.place.dp_set, "pp.init")

    # -- the framework hooks of PipelineEngineBase ---------------------------------------------------
    def _forward(self, c, i, inp, y, weight, train):
        inp = inp.to(self.device)
        first, last = self._is_first(c), self._is_last(c)
        if train and not first:
            inp.requires_grad_(True)
        catching = self.split_backward.catching() if train and self.split_backward else contextlib.nullcontext()
        with torch.set_grad_enabled(train), self._autocast(), catching as calls:
            out = self.stage(inp) if self.chunks == 1 else self.stage.forward_chunk(c, inp)
            loss = self.loss_fn(out, y.to(self.device)) if last else None
        if train:
            target = (poisoned(loss) if self.checks else loss) * weight if loss is not None else out
            self._saved[(c, i)] = (inp, target, calls)
        return out, (loss.detach() if loss is not None else None)

    def _backward(self, c, i, grad):
        inp, out, _ = self._saved.pop((c, i))
        if out.requires_grad:  # a first stage without weights (a flatten) has nothing to differentiate
            out.backward(None if grad is None else grad.to(self.device))
        if self._is_first(c):
            return None
        return inp.grad if inp.grad is not None else torch.zeros_like(inp)

    def _backward_input(self, c, i, grad):
        inp, out, calls = self._saved.pop((c, i))
        first = self._is_first(c)
        input_grad = None
        if out.requires_grad:
            input_grad, self._weight_work[(c, i)] = self.split_backward.input_half(
                out, None if grad is None else grad.to(self.device), None if first else inp, calls)
        if first:
            return None
        return input_grad if input_grad is not None else torch.zeros_like(inp)

    def _backward_weight(self, c, i):
        work = self._weight_work.pop((c, i), None)
        if work is not None:
            work.run()

    def _backward_weights(self, c, micro_batches):
        works = [w for w in (self._weight_work.pop((c, i), None) for i in micro_batches) if w is not None]
        if works:
            self.linears_batched += WeightWork.run_together(works)

    def _metrics(self, out, y):
        return self.metrics_fn(out.detach(), y.to(out.device))

    def _micro_batches(self, t, sizes):
        return list(t.tensor_split(len(sizes)))

    def _set_training(self, train):
        self.stage.train(train)

    def _begin_step(self):
        self.optimizer.zero_grad(set_to_none=False)
        self.linears_batched = 0

    def _finish_step(self):
        params = [p for p in self.stage.parameters() if p.requires_grad]
        # every replica of a weight-free stage agrees: nothing to average
        if self.sharded:
            # Horovod: this stage's gradients reduce-scattered over its replicas, each keeps its rows
            self.optimizer.synchronize()
        elif self.place.dp_set is not None and params:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            # Horovod: average this stage's gradients over its dp replicas only
            self.hvd.grouped_allreduce_([p.grad for p in params], op=self.hvd.Average, name="pp.grads",
                                        process_set=self.place.dp_set)
        if self.clip_norm or self.checks:
            norm = self._grad_norm()
            if self.checks and not self.guard.allows(math.isfinite(norm), self.step_number):
                return   # the gradients are zeroed as the next step begins
            if self.clip_norm:
                self._clip_gradients(norm)
        self.optimizer.step()   # ZeRO: each replica steps its rows, then all-gathers them

    def _stepped(self) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
        """(parameter, the tensor the optimizer steps, whether every replica holds that tensor's
        gradient): the parameter itself, or under ZeRO this replica's rows of it."""
        if self.sharded:
            return [(s.param, s.stepped, s.rows is None) for s in self.optimizer.shards]
        return [(p, p, True) for p in self.stage.parameters()]

    def _grad_norm(self) -> float:
        """The whole model's gradient norm, not the stage's: squared norms summed over all ranks,
        each gradient divided by the ranks holding the same one, what torch.nn.utils.clip_grad_norm_
        computes on the whole model. The same on every rank."""
        # A gradient averaged over the replicas is held by each of them (ZeRO: its rows by one); a
        # parameter kept whole under tensor parallelism by each of the tp ranks of its stage.
        terms = [stepped.grad.detach().double().pow(2).sum()
                 / ((1 if id(param) in self._split_ids else self.place.dims.tp)
                    * (self.place.replicas if every_replica else 1))
                 for param, stepped, every_replica in self._stepped() if stepped.grad is not None]
        squares = torch.stack(terms).sum().cpu() if terms else torch.zeros((), dtype=torch.float64)
        # Horovod: every rank's share of the squared norm, summed over the whole job
        return float(self.hvd.allreduce(squares, op=self.hvd.Sum, name="pp.grad_norm").sqrt())

    def _clip_gradients(self, norm: float) -> None:
        """Scale every stage's gradients so that the whole model's gradient norm is at most clip_norm."""
        scale = self.clip_norm / (norm + 1e-6)
        if scale < 1.0:
            for _, stepped, _ in self._stepped():
                if stepped.grad is not None:
                    stepped.grad.mul_(scale)

    def _before_step(self, step):
        if self.lr_schedule is not None:  # the LR for this step, scaled by the replicas (stages add no samples)
            self.lr_schedule.apply(self.optimizer, step, self.place.replicas)

    def sum_over_ranks(self, values, name):
        return self.hvd.allreduce(torch.from_numpy(values), op=self.hvd.Sum, name=name).numpy()

"""Pipeline-parallel training over Horovod: stages on ranks, micro-batches, dp replicas per stage.

    import horovod.torch as hvd
    from hvd_runtime.torch.pipeline import PipelineEngine, build_stage, init_pipeline

    dims = init_pipeline(stages=2)                       # Horovod: init with the pipeline's process sets
    stage = build_stage(model, dims, partition="params")  # this rank's blocks of the unchanged model
    engine = PipelineEngine(stage, dims, loss_fn=F.cross_entropy, optimizer=torch.optim.SGD(stage.parameters(), 0.1),
                            schedule="1f1b", micro_batches=4)
    loss, metrics = engine.train_step(x, y)              # same numbers on every rank
    loss, metrics = engine.evaluate(val_batches)
    engine.save_timeline(run_dir)                        # rank 0 writes timeline.json

Data: shard by replica (`num_replicas=dims.replicas, rank=dims.replica`); every stage of a replica
walks the same batches. The first stage reads x, the last y; a middle stage may pass only
`batch_size=` (it needs the micro-batch sizes). `loss_fn` must return the mean over its
micro-batch: the engine weights micro-batches by size, so a step's loss and gradients are those
of the whole batch, averaged over the dp replicas by Horovod in the stage's process set.
"""

from __future__ import annotations

import torch

from hvd_runtime.schedule import Op, build_schedule
from hvd_runtime.timeline import TimelineRecorder, save_timeline
from hvd_runtime.torch.grid import PipelineConfigError, PipelineDims, PipelineRank, init_pipeline
from hvd_runtime.torch.stage import build_stage, plan_stages

__all__ = ["PipelineDims", "PipelineEngine", "PipelineRank", "build_stage", "init_pipeline", "plan_stages"]


def micro_batch_sizes(batch: int, micro_batches: int) -> list[int]:
    """Sizes torch.tensor_split gives: the first batch % m micro-batches get one more sample."""
    if micro_batches > batch:
        raise PipelineConfigError(f"micro_batches {micro_batches} exceeds the batch size {batch}: "
                                  f"use micro_batches <= {batch}")
    q, r = divmod(batch, micro_batches)
    return [q + (i < r) for i in range(micro_batches)]


class PipelineEngine:
    """Runs one stage's part of the schedule each step, then averages its gradients over dp."""

    def __init__(self, stage: torch.nn.Module, dims: PipelineRank, loss_fn, optimizer, schedule: str = "1f1b",
                 micro_batches: int = 4, metrics_fn=None, timeline: bool = False, timeline_steps: int = 20,
                 device=None):
        import horovod.torch as hvd

        self.hvd, self.stage, self.dims = hvd, stage, dims
        self.loss_fn, self.optimizer, self.metrics_fn = loss_fn, optimizer, metrics_fn
        self.schedule, self.micro_batches = schedule, micro_batches
        self.actions = build_schedule(schedule, dims.stages, micro_batches)[dims.stage]
        self.forward_only = [a for a in build_schedule("gpipe", dims.stages, micro_batches)[dims.stage]
                             if a.op in (Op.RECV_ACT, Op.FORWARD, Op.SEND_ACT)]
        self.device = torch.device(device) if device else next(stage.parameters(), torch.empty(0)).device
        self.recorder = TimelineRecorder(dims.rank, dims.stage, dims.replica, enabled=timeline)
        self.timeline, self.timeline_steps = timeline, timeline_steps   # record the first steps only: bounded memory
        self.steps = 0
        self.peak_in_flight = 0     # most micro-batches holding activations at once, last step
        self._act_shapes: dict[int, tuple] = {}    # micro-batch size -> (shape, dtype) seen on the way in
        self._act_sent: set[int] = set()            # micro-batch sizes whose shape the next stage knows
        self._metric_names: list[str] | None = None
        self._names_synced = False
        self._sync_replicas()

    # -- set-up ---------------------------------------------------------------------------------
    def _sync_replicas(self) -> None:
        """Start every replica of this stage from replica 0's parameters and buffers."""
        if self.dims.dp_set is None:
            return
        root = self.dims.dims.rank_of(self.dims.stage, 0)
        handles = [self.hvd.broadcast_async_(t.data, root, name=f"pp.init.{name}", process_set=self.dims.dp_set)
                   for name, t in self.stage.state_dict().items()]
        for h in handles:
            self.hvd.synchronize(h)

    # -- messages -------------------------------------------------------------------------------
    def _recv_act(self, i: int, size: int) -> torch.Tensor:
        known = self._act_shapes.get(size)
        t = self.dims.prev.recv(f"act{i}", *(known or (None, None)))
        self._act_shapes[size] = (tuple(t.shape), t.dtype)
        return t.to(self.device)

    def _send_act(self, i: int, size: int, out: torch.Tensor) -> None:
        self.dims.next.send(out, f"act{i}", shape_known=size in self._act_sent)
        self._act_sent.add(size)

    def _wait_sends(self) -> None:
        for link in (self.dims.prev, self.dims.next):
            if link is not None:
                link.wait_sends()

    # -- one pass over the schedule ---------------------------------------------------------------
    def _run(self, actions, xs, ys, sizes, total: int, train: bool) -> torch.Tensor:
        """Walk this stage's actions; return [loss sum, samples, metric sums...] (zeros off the last stage)."""
        dims, rec = self.dims, self.recorder
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        grads: dict[int, torch.Tensor] = {}
        sums, peak = None, 0
        for a in actions:
            i, op = a.micro_batch, a.op
            if op is Op.RECV_ACT:
                with rec.span("recv", i):
                    inputs[i] = self._recv_act(i, sizes[i]).requires_grad_(train)
            elif op is Op.FORWARD:
                with rec.span("forward", i), torch.set_grad_enabled(train):
                    inp = xs[i].to(self.device) if dims.is_first else inputs[i]
                    out = self.stage(inp)
                    if dims.is_last:
                        loss = self.loss_fn(out, ys[i].to(self.device))
                        stats = self._stats(loss, out, ys[i], sizes[i])
                        sums = stats if sums is None else sums + stats
                        out = loss * (sizes[i] / total)
                    if train or not dims.is_last:      # evaluation keeps nothing on the last stage
                        outputs[i] = out
                    peak = max(peak, len(outputs))
            elif op is Op.SEND_ACT:
                with rec.span("send", i):
                    self._send_act(i, sizes[i], outputs[i] if train else outputs.pop(i))
            elif op is Op.RECV_GRAD:
                with rec.span("recv", i):
                    out = outputs[i]
                    grads[i] = dims.next.recv(f"grad{i}", tuple(out.shape), out.dtype).to(self.device)
            elif op is Op.BACKWARD:
                with rec.span("backward", i):
                    out = outputs.pop(i)
                    out.backward(None if dims.is_last else grads.pop(i))
            elif op is Op.SEND_GRAD:
                with rec.span("send", i):
                    inp = inputs.pop(i)
                    g = inp.grad if inp.grad is not None else torch.zeros_like(inp)
                    dims.prev.send(g, f"grad{i}", shape_known=True)
        self._wait_sends()
        if train:
            self.peak_in_flight = peak
        return sums if sums is not None else torch.zeros(2 + len(self._metric_names or []), dtype=torch.float64)

    def _stats(self, loss, out, y, n: int) -> torch.Tensor:
        values = [loss.item() * n, float(n)]
        if self.metrics_fn is not None:
            metrics = self.metrics_fn(out.detach(), y.to(out.device))
            if self._metric_names is None:
                self._metric_names = sorted(metrics)
            values += [float(metrics[k]) * n for k in self._metric_names]
        return torch.tensor(values, dtype=torch.float64)

    def _split(self, x, y, batch_size):
        n = batch_size or (len(x) if x is not None else len(y) if y is not None else None)
        if n is None:
            raise PipelineConfigError("train_step/evaluate need x, y or batch_size= on every stage")
        if self.dims.is_first and x is None:
            raise PipelineConfigError(f"stage 0 (rank {self.dims.rank}) needs the inputs x")
        if self.dims.is_last and y is None:
            raise PipelineConfigError(f"the last stage (rank {self.dims.rank}) needs the targets y")
        sizes = micro_batch_sizes(n, self.micro_batches)
        xs = list(x.tensor_split(self.micro_batches)) if x is not None else None
        ys = list(y.tensor_split(self.micro_batches)) if y is not None else None
        return xs, ys, sizes, n

    def _report(self, sums: torch.Tensor, name: str) -> tuple[float, dict[str, float]]:
        """Sample-weighted means over the last stage's replicas, delivered to every rank."""
        if not self._names_synced:
            # only the last stage has seen the metrics; every rank needs their names once
            names = self._metric_names if self.dims.is_last else None
            self._metric_names = self.hvd.broadcast_object(names or [], root_rank=self.dims.last_stage_root,
                                                           name="pp.metric_names")
            self._names_synced = True
            if len(sums) != 2 + len(self._metric_names):
                sums = torch.cat([sums, torch.zeros(2 + len(self._metric_names) - len(sums), dtype=sums.dtype)])
        total = self.hvd.allreduce(sums, op=self.hvd.Sum, name=name)
        n = total[1].item()
        return total[0].item() / n, {k: total[2 + j].item() / n for j, k in enumerate(self._metric_names)}

    # -- public -------------------------------------------------------------------------------------
    def train_step(self, x=None, y=None, batch_size: int | None = None) -> tuple[float, dict[str, float]]:
        """One optimizer step over the batch; returns (loss, metrics) averaged over dp, on every rank."""
        xs, ys, sizes, n = self._split(x, y, batch_size)
        self.stage.train()
        self.optimizer.zero_grad(set_to_none=False)
        self.recorder.step = self.steps
        self.recorder.enabled = self.timeline and self.steps < self.timeline_steps
        sums = self._run(self.actions, xs, ys, sizes, n, train=True)
        if self.dims.dp_set is not None:
            params = [p for p in self.stage.parameters() if p.requires_grad]
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            # Horovod: average this stage's gradients over its dp replicas only
            self.hvd.grouped_allreduce_([p.grad for p in params], op=self.hvd.Average, name="pp.grads",
                                        process_set=self.dims.dp_set)
        self.optimizer.step()
        self.steps += 1
        return self._report(sums, "pp.train_report")

    @torch.no_grad()
    def evaluate(self, batches) -> tuple[float, dict[str, float]]:
        """Forward-only passes over (x, y) batches; sample-weighted (loss, metrics) over dp, on every rank."""
        self.stage.eval()
        sums, recording = None, self.recorder.enabled
        self.recorder.enabled = False     # the timeline shows training steps only
        try:
            for x, y in batches:
                xs, ys, sizes, n = self._split(x, y, None)
                s = self._run(self.forward_only, xs, ys, sizes, n, train=False)
                sums = s if sums is None else sums + s
        finally:
            self.recorder.enabled = recording
        if sums is None:
            sums = torch.zeros(2 + len(self._metric_names or []), dtype=torch.float64)
        return self._report(sums, "pp.eval_report")

    def save_timeline(self, run_dir) -> None:
        """Gather every rank's timeline to rank 0, which writes run_dir/timeline.json. Call on every rank."""
        records = self.hvd.allgather_object(self.recorder.record(), name="pp.timeline")
        if self.hvd.rank() == 0:
            meta = {"schedule": self.schedule, "stages": self.dims.stages, "replicas": self.dims.replicas,
                    "micro_batches": self.micro_batches}
            save_timeline(run_dir, records, meta)

"""Training steps under ZeRO (horovod.zero 1, 2, 3) against the whole model in the same process.

    horovodrun -np 4 --gloo python zero_step.py --cases cases.json
    horovodrun -np 2 --gloo python zero_step.py --cases resume.json     # a case with "resume": DIR
    horovodrun -np 4 --gloo python zero_step.py --tp 2 --cases tp.json  # the GPT split by tp 2 x dp 2

Each case (a JSON object of the flags below, and its own "out") builds the model on the meta
device, drawn from its recipes (hvd_runtime.torch.meta_init): unsplit for the reference, and for
ZeRO 3 only this rank's rows. The ZeRO copy trains through the product's own path (make_optimizer,
TrainStep, Precision: clipping by the global norm, backward_passes_per_step, bf16 autocast), each
rank on its share of the global batch; the reference trains in one process on the whole global
batch with the framework's plain optimizer. After `steps` updates each rank reports the largest
relative error of its parameters (its rows under ZeRO 3) against the reference's, what share of
the optimizer state and of the parameters it holds, and (stage 2) whether any whole gradient
outlived a backward pass and how many bucket reduce-scatters an update sent ("bucket_bytes": its
buckets' size, to make many). "save": DIR writes the ZeRO run's checkpoint there after the steps;
"resume": DIR restores one instead of training (any ZeRO stage, any np; zero 0 at np 1: unsplit;
"saved_np": the saving job's ranks, whose batches and LR the reference repeats) and reports the errors of the restored parameters and optimizer state, and after one more step.
Under `--tp N` the model is the GPT split by tensor parallelism (apply_tp) and ZeRO cuts each
slice along the dimension tensor parallelism cut it; a rank's parameters and slots are compared
with its part of the reference's (its tp slice, then its rows of that).
A case {"check": "reducescatter"} compares ZeRO's two reduce-scatters instead (reducescatter_paths).
Rank 0 writes all ranks' reports as JSON.
"""

import argparse
import faulthandler
import json
from pathlib import Path

import horovod.torch as hvd
import torch
from torch import nn

from hvd_runtime.checkpoint import TrainState
from hvd_runtime.config import CheckpointConfig, HorovodConfig, ModelConfig, OptimConfig
from hvd_runtime.torch.checkpoint import checkpoint_store, restore_checkpoint, save_checkpoint
from hvd_runtime.torch.context import Context
from hvd_runtime.parallel.tensor_groups import init_tensor_parallel
from hvd_runtime.torch.memory_plan import largest_block
from hvd_runtime.torch.meta_init import build_on_meta, materialize
from hvd_runtime.torch.optim import make_optimizer, make_schedule, plain_optimizer
from hvd_runtime.torch.parallelize import Parallel
from hvd_runtime.torch.precision import Precision
from hvd_runtime.torch.recompute import recompute_blocks
from hvd_runtime.torch.step import TrainStep
from hvd_runtime.torch.tensor_parallel import apply_tp
from hvd_runtime.torch.tensor_state import SlicedParameters
from hvd_runtime.torch.vocab_parallel import VocabObjective
from hvd_runtime.torch import zero as zero_module
from hvd_runtime.torch.zero import BUCKET_BYTES, ZeroOptimizer, rows_by_parameter, shard_parameters

from project_module import project_module

REDUCESCATTER = zero_module._reducescatter   # each case counts the buckets it sends through it

SEED, BATCH, VOCAB, CONTEXT = 5, 4, 19, 8


def build_mlp():
    # 3 outputs: at dp 4 the last layer's rows are too few to cut, so it stays whole
    return nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 3))


def workload(case):
    """(build, num_classes, batch(generator, n))."""
    if case["model"] == "mlp":
        return build_mlp, 3, lambda g, n: (torch.randn(n, 12, generator=g), torch.randint(0, 3, (n,), generator=g))
    build_model = project_module(case["project"], "model").build_model
    cfg = ModelConfig(width=16, heads=2, layers=2, context=CONTEXT, tie_embeddings=True)

    def batch(g, n):
        tokens = torch.randint(0, VOCAB, (n, CONTEXT + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    return (lambda: build_model(cfg, (CONTEXT,), VOCAB)), VOCAB, batch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


class Reference:
    """The whole model in this process, trained on whole global batches."""

    def __init__(self, build, case, ctx, schedule, objective):
        self.model = materialize(build_on_meta(build), SEED)
        optim_cfg = OptimConfig(name=case["optim"], lr=0.05, clip_norm=case["clip"], weight_decay=0.01)
        self.optimizer = plain_optimizer(self.model.parameters(), optim_cfg, 0.0)
        self.case, self.schedule, self.objective = case, schedule, objective

    def update(self, batches, update: int, size: int):
        """One optimizer update over `batches` (the global ones), the LR that of `size` replicas."""
        k = len(batches)
        self.optimizer.zero_grad()
        for x, y in batches:
            with Precision(self.case["precision"], "cpu").autocast():
                loss = self.objective.cross_entropy(self.model(x), y)
            (loss / k).backward()
        self.schedule.apply(self.optimizer, update, size)
        if self.case["clip"]:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.case["clip"])
        self.optimizer.step()


def zero_model(build, case, ctx):
    """The model as the product makes it: on meta, split by tp, ZeRO 3's rows taken, then drawn."""
    model = build_on_meta(build)
    if ctx.tensor is not None:
        model = apply_tp(model, ctx.tensor.group)
    if case["zero"] == 3:
        cut_dims = {name: cut.dim for name, cut in SlicedParameters(model).by_name.items()}
        model = shard_parameters(model, ctx.dp_set, ctx.data_rank, ctx.data_size, cut_dims)
    if case["recompute"]:
        recompute_blocks(model)
    return materialize(model, SEED)


def param_errors(model, reference, optimizer=None, ref_optimizer=None) -> dict[str, float]:
    """Each parameter (its tp slice, and its rows under ZeRO 3) against the reference's; with the
    optimizers, each optimizer slot shaped like its parameter too (`<name>/<slot>`)."""
    rows = rows_by_parameter(model)
    splits = SlicedParameters(model).by_name
    ref = dict(reference.named_parameters())

    def part(name, t, cut=None):
        """The part of the reference's `t` this rank holds: its tp slice, then rows `cut` (dim, rows)."""
        t = t.detach()
        if name in splits:
            t = t.index_select(splits[name].dim, splits[name].index)
        return t if cut is None else t.narrow(cut[0], cut[1][0], cut[1][1] - cut[1][0])

    errors = {}
    for name, p in model.named_parameters():
        held = rows.get(id(p))
        errors[name] = rel(p.detach(), part(name, ref[name], None if held is None else (held.dim, held.rows)))
    if optimizer is not None:
        for name, stepped, cut in [(s.name, s.stepped, None if s.rows is None else (s.dim, s.rows))
                                   for s in optimizer.shards] if isinstance(optimizer, ZeroOptimizer) else \
                [(n, p, None) for n, p in model.named_parameters()]:
            ref_state = ref_optimizer.state[ref[name]]
            for slot, value in optimizer.state.get(stepped, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    errors[f"{name}/{slot}"] = rel(value, part(name, ref_state[slot], cut))
    return errors


def eval_error(step, reference, batch, n: int, r: int) -> float:
    """The step's validation loss over n + 1 batches dealt round-robin (rank 0 gets two, the others
    one: ZeRO 3's ranks must gather in lockstep though their shares differ) against the reference's
    over all of them; relative."""
    g = torch.Generator().manual_seed(23)
    batches = [batch(g, 3) for _ in range(n + 1)]
    loss, _ = step.evaluate([b for i, b in enumerate(batches) if i % n == r])
    with torch.no_grad():
        want = sum(reference.objective.cross_entropy(reference.model(x), y).item() * len(y)
                   for x, y in batches) / (3 * (n + 1))
    return abs(loss - want) / abs(want)


def run_case(case, ctx):
    build, classes, batch = workload(case)
    objective = VocabObjective.of(ctx.tensor.group if ctx.tensor else None, classes)   # split logits under tp
    hvd_cfg = HorovodConfig(zero=case["zero"], backward_passes_per_step=case["bpps"])
    optim_cfg = OptimConfig(name=case["optim"], lr=0.05, clip_norm=case["clip"], weight_decay=0.01, warmup_epochs=1)
    schedule = make_schedule(optim_cfg, hvd_cfg, steps_per_epoch=4)
    reference = Reference(build, case, ctx, schedule, VocabObjective.of(None, classes))
    model = zero_model(build, case, ctx)
    zero_module.BUCKET_BYTES = case.get("bucket_bytes", BUCKET_BYTES)   # ZeRO's buckets
    optimizer, _ = make_optimizer(model, optim_cfg, hvd_cfg, ctx, steps_per_epoch=4,
                                  slices=SlicedParameters(model) if ctx.tensor else None)
    norm = optimizer.grad_norm if isinstance(optimizer, ZeroOptimizer) else None
    step = TrainStep(model, optimizer, schedule, objective.cross_entropy, ctx, case["bpps"],
                     Precision(case["precision"], ctx.device, case["clip"], norm))
    g = torch.Generator().manual_seed(11)
    n, r, k = ctx.data_size, ctx.data_rank, case["bpps"]
    whole_grads_kept = False
    sent = []   # the names of the gradient buckets reduce-scattered, in order
    blocks = []   # ZeRO 3: elements of each block's whole gradients reduce-scattered at once

    def counted(tensors, dims, dp_set, name, *args, **kwargs):
        if name.startswith("zero.grads."):
            sent.append(name)
        if name.startswith("zero3.") and name.endswith(".grad"):
            blocks.append(sum(t.numel() for t in tensors))
        return REDUCESCATTER(tensors, dims, dp_set, name, *args, **kwargs)

    zero_module._reducescatter = counted

    def train(update: int):
        nonlocal whole_grads_kept
        batches = [batch(g, BATCH * n) for _ in range(k)]
        for i, (x, y) in enumerate(batches):
            step.train_batch(x[r * BATCH:(r + 1) * BATCH], y[r * BATCH:(r + 1) * BATCH], i == k - 1, update * k + i)
            if i < k - 1 and isinstance(optimizer, ZeroOptimizer) and optimizer.stage == 2:
                whole_grads_kept |= any(s.param.grad is not None for s in optimizer.shards if s.rows is not None)
        reference.update(batches, update, n)

    report = {"rank": hvd.rank(), "zero": case["zero"]}
    if case.get("resume"):
        saved_n = case["saved_np"]   # the reference alone, as the saving job's: the checkpoint holds the rest
        for update in range(case["steps"]):
            reference.update([batch(g, BATCH * saved_n) for _ in range(k)], update, saved_n)
        parallel = Parallel(model, optimizer, step, SlicedParameters(model) if ctx.tensor else None)
        state = restore_checkpoint(checkpoint_store(CheckpointConfig(dir=case["resume"]), ctx),
                                   parallel, ctx)
        report["restored_step"] = state.step
        report["restored"] = param_errors(model, reference.model, optimizer, reference.optimizer)
    else:
        for update in range(case["steps"]):
            train(update)
        report["bucket_sends"] = len(sent) / case["steps"]
        # what the memory plan counts ZeRO 3 holding whole: the largest block of the model as this rank cuts it
        planned = build_on_meta(build)
        report["largest_block"] = {"gathered": max(blocks, default=0), "planned": largest_block(
            apply_tp(planned, ctx.tensor.group) if ctx.tensor is not None else planned)}
        if case.get("save"):
            parallel = Parallel(model, optimizer, step, SlicedParameters(model) if ctx.tensor else None)
            save_checkpoint(checkpoint_store(CheckpointConfig(dir=case["save"]), ctx), parallel,
                            TrainState(step=case["steps"] * k, epoch=0), ctx)
    report["errors"] = param_errors(model, reference.model, optimizer, reference.optimizer)
    report["eval_error"] = eval_error(step, reference, batch, n, r)
    train(case["steps"])
    report["after_one_more"] = param_errors(model, reference.model)
    if isinstance(optimizer, ZeroOptimizer):
        held = sum(v.numel() for s in optimizer.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0)
        whole = sum(v.numel() for s in reference.optimizer.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        report["optimizer_share"] = held / whole
        report["parameter_share"] = sum(p.numel() for p in model.parameters()) / \
            sum(p.numel() for p in reference.model.parameters())
        report["whole_grads_kept"] = whole_grads_kept
        report["buckets"] = len(optimizer._buckets)
    return report


def reducescatter_paths(ctx) -> dict:
    """Horovod's grouped reduce-scatter (ZeRO's path for GPU tensors) and the all-to-all one (CPU)
    on the same tensors, cut along dims 0 and 1 and uneven: the largest difference."""
    from hvd_runtime.torch.zero import _reducescatter

    g = torch.Generator().manual_seed(3 + hvd.rank())
    tensors = [torch.randn(7, 5, generator=g), torch.randn(6, 9, generator=g), torch.randn(10, generator=g)]
    dims = [0, 1, 0]
    native = _reducescatter(tensors, dims, ctx.dp_set, "check.native", alltoall=False)
    by_alltoall = _reducescatter(tensors, dims, ctx.dp_set, "check.alltoall", alltoall=True)
    return {"rank": hvd.rank(), "shapes": [list(t.shape) for t in by_alltoall],
            "max_diff": max(float((a - b).abs().max()) for a, b in zip(native, by_alltoall))}


def main():
    faulthandler.dump_traceback_later(240, exit=True)
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True, help="a JSON list of cases (see the module's docstring)")
    ap.add_argument("--tp", type=int, default=0, help="split the GPT over tensor-parallel groups of this size")
    args = ap.parse_args()
    if args.tp:
        ctx = Context(torch.device("cpu"), tensor=init_tensor_parallel(hvd, args.tp))
    else:
        hvd.init()
        ctx = Context(torch.device("cpu"))
    torch.set_num_threads(1)
    defaults = {"model": "mlp", "project": None, "optim": "adamw", "clip": 0.0, "bpps": 1, "precision": "fp32",
                "recompute": False, "steps": 2}
    for case in json.loads(Path(args.cases).read_text()):
        case = {**defaults, **case}
        report = reducescatter_paths(ctx) if case.get("check") == "reducescatter" else run_case(case, ctx)
        reports = hvd.allgather_object(report, name=f"reports.{case['out']}")
        if hvd.rank() == 0:
            Path(case["out"]).write_text(json.dumps(reports))


if __name__ == "__main__":
    main()

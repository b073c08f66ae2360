"""Numerical checks of hvd_runtime.torch's data parallelism, run under horovodrun -np 2.

Each check compares what the ranks do together against one process doing the same work on the
global batch, and prints `OK <name>` on rank 0 when it holds.
"""

import checks  # beside this script: report()
import contextlib
import io
import random
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

import horovod.torch as hvd
from hvd_runtime.checkpoint import CheckpointStore
from hvd_runtime.checkpoint import TrainState
from hvd_runtime.config import ConfigError, HorovodConfig, OptimConfig
from hvd_runtime.sharded import shard_description, write_checkpoint
from hvd_runtime.loop import means_over_ranks  # noqa: E402
from hvd_runtime.nonfinite import Guard, NonFinite  # noqa: E402
from hvd_runtime.torch.parallelize import Parallel  # noqa: E402
from hvd_runtime.torch.recompute import recompute_blocks  # noqa: E402
from hvd_runtime.torch.step import TrainStep, sum_over_ranks  # noqa: E402
from hvd_runtime.torch import (SyncBatchNorm, init_horovod, make_optimizer, restore_checkpoint,
                               use_sync_batchnorm)

warnings.filterwarnings("ignore")
ctx = init_horovod(seed=0, threads_per_rank=1)
assert ctx.size == 2, "run with -np 2"
R = ctx.rank
TOL = 1e-5


def model_fn(batch_norm=False):
    torch.manual_seed(123)  # identical init on every rank and in the reference
    layers = [nn.Linear(6, 8)] + ([nn.BatchNorm1d(8)] if batch_norm else []) + [nn.ReLU(), nn.Linear(8, 3)]
    return nn.Sequential(*layers)


g = torch.Generator().manual_seed(7)
X, Y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
loss_fn = nn.CrossEntropyLoss()
plain = OptimConfig(name="sgd", lr=0.1, momentum=0.0, scale_lr=False, warmup_epochs=0)


def max_rel_diff(a: nn.Module, b: nn.Module) -> float:
    return max(((p - q).abs().max() / q.abs().max().clamp_min(1e-12)).item()
               for p, q in zip(a.parameters(), b.parameters()))


def report(name: str, ok: bool, detail: str = "") -> None:
    checks.report(hvd, name, ok, detail)


# 1. One DistributedOptimizer step on two half-batches == one plain step on the whole batch.
reference = model_fn()
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
loss_fn(reference(X), Y).backward()
ref_opt.step()

model = model_fn()
opt, _ = make_optimizer(model, plain, HorovodConfig(), ctx, steps_per_epoch=1)
opt.zero_grad()
loss_fn(model(X.chunk(2)[R]), Y.chunk(2)[R]).backward()
opt.step()
diff = max_rel_diff(model, reference)
report("allreduce_step_matches_global_batch", diff < TOL, f"max rel diff {diff:.2e}")

# 2. backward_passes_per_step=2: two local batches, one allreduce == one step on all four quarters.
model = model_fn()
opt, _ = make_optimizer(model, plain, HorovodConfig(backward_passes_per_step=2), ctx, steps_per_epoch=2)
opt.zero_grad()
quarters_x, quarters_y = X.chunk(4), Y.chunk(4)
for k in range(2):
    (loss_fn(model(quarters_x[2 * R + k]), quarters_y[2 * R + k]) / 2).backward()
opt.step()
diff = max_rel_diff(model, reference)
report("backward_passes_per_step_accumulates", diff < TOL, f"max rel diff {diff:.2e}")

# 3. fp16 compression: the same step, to fp16 precision.
model = model_fn()
opt, _ = make_optimizer(model, plain, HorovodConfig(fp16_compression=True), ctx, steps_per_epoch=1)
opt.zero_grad()
loss_fn(model(X.chunk(2)[R]), Y.chunk(2)[R]).backward()
opt.step()
diff = max_rel_diff(model, reference)
report("fp16_compression_close", diff < 1e-2, f"max rel diff {diff:.2e}")

# 4. SyncBatchNorm: each rank's output equals BatchNorm over the global batch, sliced.
reference = model_fn(batch_norm=True).train()
synced = use_sync_batchnorm(model_fn(batch_norm=True)).train()
assert isinstance(synced[1], SyncBatchNorm)
expected = reference(X)
got = synced(X.chunk(2)[R])
diff = ((got - expected.chunk(2)[R]).abs().max() / expected.abs().max()).item()
report("sync_batchnorm_uses_global_statistics", diff < TOL, f"max rel diff {diff:.2e}")
# ...and its gradients, averaged by the optimizer, equal the global-batch gradients.
loss_fn(expected, Y).backward()
loss_fn(got, Y.chunk(2)[R]).backward()
grads = [hvd.allreduce(p.grad, op=hvd.Average, name=f"g{i}") for i, p in enumerate(synced.parameters())]
# (The bias before a BatchNorm has a gradient of ~0, so compare with an absolute floor.)
ok = all(torch.allclose(a, p.grad, rtol=1e-4, atol=1e-7) for a, p in zip(grads, reference.parameters()))
diff = max((a - p.grad).abs().max().item() for a, p in zip(grads, reference.parameters()))
report("sync_batchnorm_gradients_match", ok, f"max abs diff {diff:.2e}")
stats = ((synced[1].running_var - reference[1].running_var).abs().max()).item()
report("sync_batchnorm_running_stats_match", stats < 1e-5, f"max abs diff {stats:.2e}")

# 5. Metrics over uneven shards: global sums / global count, not a mean of means.
values = torch.arange(5.0) if R == 0 else torch.arange(5.0, 7.0)
means = means_over_ranks({"v": values.sum()}, len(values), sum_over_ranks, "check.means")
report("metric_average_weights_by_count", abs(means["v"] - 3.0) < 1e-12, f"got {means['v']}")

# 6. Ranks initialised differently start identical after restore_checkpoint; LR warmup scales.
torch.manual_seed(1000 + R)
model = nn.Linear(4, 2)
scaled = OptimConfig(name="sgd", lr=0.1, momentum=0.9, scale_lr=True, warmup_epochs=1)
opt, schedule = make_optimizer(model, scaled, HorovodConfig(), ctx, steps_per_epoch=4)
with tempfile.TemporaryDirectory() as tmp:
    state = restore_checkpoint(CheckpointStore(tmp, is_writer=R == 0), Parallel(model, opt, None), ctx)
weights = hvd.allgather_object(model.weight.detach().clone())
lrs = []
for step in range(5):
    schedule.apply(opt, step, ctx.size)
    lrs.append(opt.param_groups[0]["lr"])
report("broadcast_makes_ranks_identical", torch.equal(weights[0], weights[1]) and state.epoch == 0)
expected_lrs = [0.1, 0.125, 0.15, 0.175, 0.2]
report("lr_warms_up_to_world_size_times_lr", all(abs(a - b) < 1e-9 for a, b in zip(lrs, expected_lrs)),
       f"{lrs}")

# 7. A checkpoint of the format before shards (one torch.save'd file from rank 0: the model's and
# optimizer's state dicts, the position, each rank's RNG objects) still resumes: every rank takes
# its weights, momentum and position, and its own RNG state back; the next checkpoint is a folder.
torch.manual_seed(2000 + R)
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model(torch.ones(3, 4)).sum().backward()
opt.step()
saved_python_rng = random.getstate()
rngs = hvd.allgather_object({"python": saved_python_rng, "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state(), "cuda": []})
old = {"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": rngs,
       "state": {"epoch": 3, "step": 30, "samples_in_epoch": 12, "run_id": None}}
expected = hvd.broadcast_object((model.weight.detach().clone(), opt.state[model.weight]["momentum_buffer"].clone()))
with tempfile.TemporaryDirectory() as tmp:
    tmp = hvd.broadcast_object(tmp)
    store = CheckpointStore(tmp, is_writer=R == 0)
    if R == 0:
        torch.save(old, store.path_for(30))
    hvd.barrier()
    fresh = nn.Linear(4, 2)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    random.seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = restore_checkpoint(store, Parallel(fresh, fresh_opt, None), ctx)
    drawn = random.random()
    random.setstate(saved_python_rng)
    same_rng = drawn == random.random()
    ok = (torch.equal(fresh.weight, expected[0]) and torch.equal(fresh_opt.state[fresh.weight]["momentum_buffer"],
                                                                  expected[1])
          and (state.epoch, state.step, state.samples_in_epoch) == (3, 30, 12) and same_rng)
    hvd.barrier()
report("a_checkpoint_from_before_shards_resumes", ok)

# 7. A non-finite update (rank 1's second batch is NaN): skipped on both ranks alike, the optimizer's
# momentum with it, so each rank ends equal to one process trained on the first and third global
# batches only; under `stop` both ranks stop at that step, holding the first step's weights.
momentum = OptimConfig(name="sgd", lr=0.1, momentum=0.9, scale_lr=False, warmup_epochs=0)
batches = [(torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(3)]
reference = model_fn()
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
for x, y in (batches[0], batches[2]):
    ref_opt.zero_grad()
    loss_fn(reference(x), y).backward()
    ref_opt.step()
for policy in ("skip", "stop"):
    model = model_fn()
    opt, schedule = make_optimizer(model, momentum, HorovodConfig(), ctx, steps_per_epoch=3)
    guard = Guard(policy, max_skipped=1, is_root=lambda: False)
    step = TrainStep(model, opt, schedule, loss_fn, ctx, guard=guard)
    stopped_at, after_first = None, None
    for i, (x, y) in enumerate(batches):
        x = x.chunk(2)[R].clone()
        if i == 1 and R == 1:
            x[0, 0] = float("nan")
        try:
            step.train_batch(x, y.chunk(2)[R], True, i)
        except NonFinite as exc:
            stopped_at = exc.step
            break
        after_first = after_first or [p.detach().clone() for p in model.parameters()]
    if policy == "skip":
        diff = max_rel_diff(model, reference)
        report("a_nonfinite_update_is_skipped_on_every_rank_alike", diff < TOL and guard.skipped == 1,
               f"max rel diff {diff:.2e}, {guard.skipped} skipped")
    else:
        same = all(torch.equal(p, q) for p, q in zip(model.parameters(), after_first))
        report("a_nonfinite_update_stops_every_rank_before_it", stopped_at == 2 and same, f"stopped at {stopped_at}")

# 8. A shard that cannot be written: where rank 1's disk is full, every rank learns the checkpoint
# was not written (nothing published, nothing left behind, one failure counted); where the folder
# rank 0 staged is not there for the ranks (--checkpoint.dir not shared), every rank stops at once.
both_write = type("Ctx", (), {"rank": R, "data_rank": 0, "coords": None})()   # as a pipeline's stages


def write_shard(folder, write_whole):
    if R == 1:
        raise OSError(28, "No space left on device")
    path = folder / f"rank-{R:05d}.safetensors"
    path.write_bytes(b"")
    return shard_description(path, {}, {})


class Unshared(CheckpointStore):
    def staging(self, step):
        folder = super().staging(step)
        folder.rmdir()   # as if it were on a disk of rank 0's alone
        return folder


with tempfile.TemporaryDirectory() as tmp:
    tmp = hvd.broadcast_object(tmp)
    store = CheckpointStore(tmp, is_writer=R == 0, max_failures=2)
    with contextlib.redirect_stderr(io.StringIO()) as said:
        written = write_checkpoint(hvd, store, both_write, TrainState(step=10), write_shard, None, None)
    verdicts = hvd.allgather_object(written)
    first_words = "checkpoint: checkpoint 10 was not written, and there is no checkpoint before it: rank 1 could not"
    warned = said.getvalue().startswith(first_words) if R == 0 else not said.getvalue()   # rank 0 alone says it
    full_ok = (verdicts == [False, False] and store.failures.in_a_row == 1 and not list(Path(tmp).iterdir())
               and all(hvd.allgather_object(warned)))
    try:
        write_checkpoint(hvd, Unshared(tmp, is_writer=R == 0), both_write, TrainState(step=20), write_shard, None, None)
        stopped = None
    except ConfigError as exc:
        stopped = str(exc)
    stopped_all = hvd.allgather_object(stopped is not None and "must see --checkpoint.dir (a shared volume)" in stopped)
    hvd.barrier()
report("a_shard_not_written_fails_the_checkpoint_on_every_rank", full_ok, f"{verdicts} {said.getvalue()!r}")
report("a_folder_the_ranks_cannot_see_stops_every_rank_at_once", stopped_all == [True, True], f"{stopped}")

# 9. Recomputed blocks (model.recompute: blocks): one averaged step with BatchNorm and dropout,
# the blocks' forwards run again in backward, equals the same step with the activations kept:
# the same dropout masks, BatchNorm's running statistics updated once.
def dropout_model():
    torch.manual_seed(321)
    return nn.Sequential(nn.Linear(6, 8), nn.Sequential(nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5)),
                         nn.Linear(8, 3)).train()


stepped = []
for recompute in (False, True):
    model = recompute_blocks(dropout_model()) if recompute else dropout_model()
    opt, _ = make_optimizer(model, plain, HorovodConfig(), ctx, steps_per_epoch=1)
    opt.zero_grad()
    torch.manual_seed(55 + R)
    loss_fn(model(X.chunk(2)[R]), Y.chunk(2)[R]).backward()
    opt.step()
    stepped.append(model)
plain_model, recomputed = stepped
diff = max(max_rel_diff(recomputed, plain_model),
           *((a - b).abs().max().item() for a, b in zip(recomputed.buffers(), plain_model.buffers())))
report("recomputed_blocks_match_kept_activations", diff < TOL and type(recomputed[1]).__name__ == "Sequential",
       f"max diff {diff:.2e}")

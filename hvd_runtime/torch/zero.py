"""Sharded data parallelism over the data-parallel ranks (`horovod.zero: 1 | 2 | 3`), as ZeRO shards it.

    model = shard_parameters(model, dp_set, dp_rank, dp_size)   # stage 3: on the meta model, before it is real
    optimizer = ZeroOptimizer(model, plain_optimizer, stage, dp_set)

Each of N data-parallel ranks owns a 1/N part of every parameter: its rows (dim 0), cut as
Horovod's reduce-scatter cuts a tensor (the first `rows % N` ranks one row more), so that the
averaged gradient rows a reduce-scatter hands a rank are the rows it steps. A tensor of fewer rows
than ranks (a bias of a narrow layer) is not cut: every rank keeps it whole, its gradient allreduced.
Under tensor parallelism a slice is cut along the dimension tensor parallelism cut it (a
row-parallel layer's columns: `cut_dims`, its collectives on the transpose), so that what a rank
holds is one run of the whole tensor's positions along one dimension, as checkpoints describe it.

- stage 1: the optimizer state is sharded. Backward leaves the whole gradient on every rank; the
  step reduce-scatters it (averaged), each rank's optimizer steps its rows of each parameter (a
  view into the parameter, so the update lands in place) and the updated rows are all-gathered,
  both a bucket of parameters (16 MB) at a time.
- stage 2: the gradients too. As backward produces them, each bucket of gradients (16 MB, in
  backward's order) is reduce-scattered while backward goes on, and the whole gradients are
  dropped: a rank keeps only its rows, summed over backward_passes_per_step.
- stage 3: the parameters too. A rank holds only its rows; each block (hvd_runtime.torch.stage's
  blocks, and the model's own parameters outside them) all-gathers its parameters just before its
  forward, in one grouped collective, through an autograd function whose backward reduce-scatters
  the block's gradients back to the rows, again in one. The gathered tensors autograd saves for
  backward are not kept: it saves markers and gathers the block again when backward first needs
  one (or the block's recomputation does, under `model.recompute: blocks`). The model's classes
  and state_dict names are unchanged.

The global gradient norm (clipping, the non-finite check) sums each rank's rows over the job,
each gradient counted once however many ranks hold it; fp16's overflow verdict is the set's.
Checkpoints write each rank's rows under their whole-model names (hvd_runtime.torch.checkpoint),
so any layout resumes them.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch import nn

from hvd_runtime.torch.fusion import in_fusion_buffers
from hvd_runtime.torch.meta_init import take
from hvd_runtime.torch.recompute import is_recomputed, swap_class_beneath
from hvd_runtime.torch.stage import named_blocks
from hvd_runtime.zero_rows import is_cut, row_range

__all__ = ["ZeroOptimizer", "in_lockstep", "rows_by_parameter", "shard_parameters"]

# ZeRO's buckets of gradients to reduce-scatter and of rows to all-gather: smaller than a fusion
# buffer, since each one's whole tensors, its send buffer and what it receives live at once on top of
# the sharded state (stage 2's backward holds about two buckets whole: the one filling, the one in
# flight). docs/zero.md weighs 8, 16 and 64 MB.
BUCKET_BYTES = 16 * 2**20


def _along(t: torch.Tensor, dim: int) -> torch.Tensor:
    """`t` with `dim` first, contiguous: what Horovod's reduce-scatter and all-gather cut (dim 0)."""
    return t.contiguous() if dim == 0 else t.transpose(0, dim).contiguous()


def _back(t: torch.Tensor, dim: int) -> torch.Tensor:
    """`_along`'s inverse (a view)."""
    return t if dim == 0 else t.transpose(0, dim)


@dataclass
class Shard:
    """One parameter under ZeRO: its name in the whole model, the shape this rank's model has it in
    without ZeRO, this rank's rows of it along `dim` (None: held whole) and the tensor the
    optimizer steps (the rows, or the parameter when whole)."""

    name: str
    param: nn.Parameter
    shape: tuple[int, ...]
    rows: tuple[int, int] | None
    stepped: torch.Tensor
    dim: int = 0


# -- stage 3: each rank holds its rows; blocks gather before they run -----------------------------

def shard_parameters(model: nn.Module, dp_set, dp_rank: int, dp_size: int,
                     cut_dims: dict[str, int] | None = None) -> nn.Module:
    """Stage 3, on the meta `model` (hvd_runtime.torch.meta_init): each parameter cut into rows is
    replaced by this rank's rows of it (still meta: materialize draws only them), and every block
    made to gather its parameters before it runs. Tied parameters stay one. `cut_dims`: the
    dimension to cut a parameter along, by name (tensor parallelism's; 0 for any other, and 0 or 1
    only). Each module records which of its parameters are rows of which (`_hvd_zero_rows`):
    materialize makes new tensors, so the record is the module's, not the tensor's. Returns `model`."""
    names = {id(p): name for name, p in model.named_parameters()}
    replaced: dict[int, tuple[nn.Parameter, _Rows | None]] = {}
    for owner in model.modules():
        owner._hvd_zero_rows = {}
        for key, p in list(owner._parameters.items()):
            if p is None:
                continue
            if id(p) not in replaced:
                shape, dim = tuple(p.shape), (cut_dims or {}).get(names[id(p)], 0)
                held = _Rows(names[id(p)], shape, row_range(shape[dim], dp_rank, dp_size), dim) \
                    if is_cut(shape, dp_size, dim) else None
                cut = None if held is None else slice(*held.rows)
                replaced[id(p)] = (p if held is None else take(p, rows=cut) if dim == 0 else take(p, cols=cut), held)
            owner._parameters[key], held = replaced[id(p)]
            if held is not None:
                owner._hvd_zero_rows[key] = held
    for _, block in named_blocks(model):
        _gathering(block, dp_set)
    _gathering(model, dp_set, own_only=True)
    return model


@dataclass(frozen=True)
class _Rows:
    """What a stage-3 parameter holds: rows [start, stop) along `dim` of the model's `name`, of
    `shape` (tensor parallelism's slice of it, where it has one)."""

    name: str
    shape: tuple[int, ...]
    rows: tuple[int, int]
    dim: int = 0


def _held_rows(module: nn.Module, skip: set[int] = frozenset()) -> list[tuple[nn.Module, str, _Rows]]:
    """(owner, attribute, rows) of every stage-3 parameter in `module` (a tied one as often as it is
    an attribute), outside the modules whose ids are in `skip`."""
    return [(owner, key, held) for owner in module.modules() if id(owner) not in skip
            for key, held in getattr(owner, "_hvd_zero_rows", {}).items()]


def rows_by_parameter(model: nn.Module) -> dict[int, _Rows]:
    """id(parameter) -> its rows, for every stage-3 parameter of `model`."""
    return {id(owner._parameters[key]): held for owner, key, held in _held_rows(model)}


class _Gather(torch.autograd.Function):
    """A block's rows -> its whole tensors (one grouped all-gather over the set); backward: their
    whole gradients -> this rank's rows of their average over the set (one grouped reduce-scatter),
    once autograd has every one of them: at the end of the block's backward."""

    @staticmethod
    def forward(ctx, how: tuple, *rows: torch.Tensor):
        dp_set, name, dims = how
        gathered = _allgather(rows, dims, dp_set, name)
        ctx.how, ctx.shapes, ctx.device = how, [t.shape for t in gathered], rows[0].device
        return tuple(gathered)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        dp_set, name, dims = ctx.how
        grads = [torch.zeros(shape, device=ctx.device) if g is None else g for g, shape in zip(grads, ctx.shapes)]
        return (None, *_reducescatter(grads, dims, dp_set, f"{name}.grad"))


def _allgather(rows, dims, dp_set, name: str) -> list[torch.Tensor]:
    """The whole tensors of `rows`, each cut along its dimension in `dims` (one grouped all-gather)."""
    return _gathered(_start_allgather(rows, dims, dp_set, name))


def _start_allgather(rows, dims, dp_set, name: str) -> tuple:
    """`_allgather` started, to be finished by `_gathered`."""
    import horovod.torch as hvd

    return hvd.grouped_allgather_async([_along(t.detach(), d) for t, d in zip(rows, dims)], process_set=dp_set,
                                       name=name), dims


def _gathered(started) -> list[torch.Tensor]:
    import horovod.torch as hvd

    handle, dims = started
    return [_back(t, d) for t, d in zip(hvd.synchronize(handle), dims)]


def _reducescatter(tensors, dims, dp_set, name: str, handle: bool = False, alltoall: bool | None = None):
    """This rank's rows of the average of `tensors` over the set, each cut along its dimension in
    `dims`: one grouped reduce-scatter, or one all-to-all (`_by_alltoall`: `alltoall`, by default
    on CPU); `handle`: started, to be finished by `_rows_of`."""
    import horovod.torch as hvd

    along = [_along(t, d) for t, d in zip(tensors, dims)]
    if along[0].device.type == "cpu" if alltoall is None else alltoall:
        started = _by_alltoall(along, dp_set, name)
    else:
        started = hvd.grouped_reducescatter_async(along, op=hvd.Average, process_set=dp_set, name=name), None
    return (started, dims) if handle else _rows_of((started, dims))


def _by_alltoall(along: list[torch.Tensor], dp_set, name: str) -> tuple:
    """A reduce-scatter as one all-to-all: each rank sends every other rank that rank's rows of each
    tensor and sums what it receives, its own rows from every rank. Where Horovod's reduce-scatter
    runs over Gloo (CPU) it costs more than an allreduce of the same tensors; the all-to-all sends
    each row once, as a ring reduce-scatter does (bench: docs/benchmarks-zero.md)."""
    import horovod.torch as hvd

    size, rank = dp_set.size(), dp_set.rank()
    cuts = [[row_range(t.shape[0], r, size) for r in range(size)] for t in along]
    send = torch.cat([t[a:b].reshape(-1) for r in range(size) for t, cut in zip(along, cuts) for a, b in [cut[r]]])
    splits = torch.tensor([sum((cut[r][1] - cut[r][0]) * t[0].numel() for t, cut in zip(along, cuts))
                           for r in range(size)], dtype=torch.int32)
    started = hvd.alltoall_async(send, splits=splits, name=name, process_set=dp_set)
    mine = [(t.shape, cut[rank]) for t, cut in zip(along, cuts)]
    return started, (size, mine)


def _rows_of(started) -> list[torch.Tensor]:
    """The rows a `_reducescatter(..., handle=True)` hands this rank, once it is done."""
    import horovod.torch as hvd

    (handle, alltoall), dims = started
    if alltoall is None:
        rows = hvd.synchronize(handle)
    else:
        size, mine = alltoall
        received = hvd.synchronize(handle)
        received = received[0] if isinstance(received, tuple) else received
        summed = received.view(size, -1).sum(0).div_(size)
        rows, at = [], 0
        for shape, (a, b) in mine:
            count = (b - a) * shape[1:].numel()
            rows.append(summed[at:at + count].view(b - a, *shape[1:]))
            at += count
    return [_back(t, d) for t, d in zip(rows, dims)]


def _one_ahead(buckets: list, start, finish) -> None:
    """`start(i, bucket)` for each bucket in order, and `finish(bucket, started)` for each once the
    next one has started: Horovod's thread sends one bucket while the rank's thread finishes the
    last (sums its rows, or copies its whole tensors into place)."""
    previous = None
    for i, bucket in enumerate(buckets):
        started = start(i, bucket)
        if previous is not None:
            finish(*previous)
        previous = bucket, started
    if previous is not None:
        finish(*previous)


class _Gathering:
    """Marks a module whose forward gathers its sharded parameters first."""


def _gathering(module: nn.Module, dp_set, own_only: bool = False) -> None:
    """Give `module` a forward that runs on its parameters gathered over `dp_set`; `own_only`: only
    those outside its blocks (the root, whose blocks gather their own). Beneath recomputation,
    where the block has it: a recomputed forward gathers again."""
    module._hvd_zero_own, module._hvd_zero_set = own_only, dp_set
    if not isinstance(module, _Gathering):
        swap_class_beneath(module, _gathering_class)


@functools.cache
def _gathering_class(cls: type) -> type:
    def forward(self, *args, **kwargs):
        return _run_gathered(self, super(gathering, self).forward, args, kwargs)

    gathering = type(cls.__name__, (_Gathering, cls), {"forward": forward, "__module__": cls.__module__,
                                                        "__qualname__": cls.__qualname__})
    return gathering


def _run_gathered(module: nn.Module, forward, args, kwargs):
    """`forward` (the module's own) with its stage-3 parameters gathered whole in their places, in
    one collective named by the module's first parameter's whole-model name (alike on every rank)."""
    dp_set = module._hvd_zero_set
    skip = {id(m) for _, block in named_blocks(module) for m in block.modules()} if module._hvd_zero_own else set()
    sharded = _held_rows(module, skip)
    if not sharded:
        return forward(*args, **kwargs)
    grad = torch.is_grad_enabled()
    held = {id(owner._parameters[key]): (owner._parameters[key], rows.dim) for owner, key, rows in sharded}
    params, dims = [p for p, _ in held.values()], tuple(d for _, d in held.values())
    name = f"zero3.{sharded[0][2].name}"
    gathered = _Gather.apply((dp_set, name, dims), *params) if grad else _allgather(params, dims, dp_set, name)
    whole = {id(p): t for p, t in zip(params, gathered)}
    # Autograd would keep each gathered tensor it saves until backward: a marker instead, and the
    # block gathered again when backward first needs one, dropped once the last marker is read.
    index = {t.untyped_storage().data_ptr(): (i, t.dtype) for i, t in enumerate(gathered)}
    again = {"tensors": None, "markers": 0}

    def pack(t: torch.Tensor):
        found = index.get(t.untyped_storage().data_ptr()) if t.numel() else None
        if found is None or t.dtype != found[1]:
            return t
        again["markers"] += 1
        return (found[0], tuple(t.shape), t.stride(), t.storage_offset())

    def unpack(saved):
        if isinstance(saved, torch.Tensor):
            return saved
        if again["tensors"] is None:
            again["tensors"] = _allgather(params, dims, dp_set, f"{name}.again")
        i, shape, stride, offset = saved
        t = again["tensors"][i].as_strided(shape, stride, offset)
        again["markers"] -= 1
        if not again["markers"]:
            again["tensors"] = None
        return t

    hooks = (torch.autograd.graph.saved_tensors_hooks(pack, unpack) if grad and not is_recomputed(module)
             else contextlib.nullcontext())   # a recomputed block's checkpoint keeps only its input
    rows = [(owner, key, owner._parameters[key]) for owner, key, _ in sharded]
    try:
        for owner, key, p in rows:
            owner._parameters[key] = whole[id(p)]
        with hooks:
            return forward(*args, **kwargs)
    finally:
        for owner, key, p in rows:
            owner._parameters[key] = p


def in_lockstep(batches, idle_forward):
    """Stage 3's evaluation: every forward is a collective of the replicas, but a rank's share of the
    validation set may hold a batch fewer than another's (or none). Yields this rank's batches;
    while any other rank still has one, a rank out of batches runs `idle_forward(x)` on one
    sample of another rank's, whose output it drops. (ZeRO shards over every rank of the job.)"""
    import horovod.torch as hvd

    batches = iter(batches)
    while True:
        batch = next(batches, None)
        said = hvd.allgather_object(None if batch is None else batch[0][:1].cpu(), name="zero3.eval.lockstep")
        if all(sample is None for sample in said):
            return
        if batch is None:
            idle_forward(next(sample for sample in said if sample is not None))
        else:
            yield batch


# -- the optimizer: every stage steps this rank's rows -------------------------------------------

class ZeroOptimizer:
    """The framework optimizer over this rank's rows of each parameter, with ZeRO's collectives
    around its step. What hvd_runtime.torch.step and precision drive, as they drive Horovod's
    DistributedOptimizer: zero_grad, synchronize, skip_synchronize, step, param_groups, state."""

    def __init__(self, model: nn.Module, make_optimizer, stage: int, dp_set, dp_rank: int, dp_size: int,
                 slices=None):
        """`make_optimizer(tensors)`: the framework optimizer over the tensors to step. `slices`:
        tensor parallelism's SlicedParameters of `model`, whose slices are cut along the dimension
        it cut them (stage 3: as shard_parameters cut them) and counted once by the norm."""
        self.stage, self.dp_set, self.dp_size = stage, dp_set, dp_size
        self.tp_split = {} if slices is None else {pid: cut.group.size for pid, cut in slices.by_param.items()}
        self.tp = max(self.tp_split.values(), default=1)
        self.shards: list[Shard] = []
        held_rows = rows_by_parameter(model) if stage == 3 else {}
        for name, p in model.named_parameters():   # a tied parameter once, by its first name
            if stage == 3:
                held = held_rows.get(id(p))
                self.shards.append(Shard(name, p, tuple(p.shape), None, p) if held is None else
                                   Shard(name, p, held.shape, held.rows, p, held.dim))
                continue
            dim = slices.by_param[id(p)].dim if slices is not None and id(p) in slices.by_param else 0
            if is_cut(p.shape, dp_size, dim):
                rows = row_range(p.shape[dim], dp_rank, dp_size)
                view = p.detach().narrow(dim, rows[0], rows[1] - rows[0])   # stepped in place
                self.shards.append(Shard(name, p, tuple(p.shape), rows, view, dim))
            else:
                self.shards.append(Shard(name, p, tuple(p.shape), None, p))
        self.inner = make_optimizer([s.stepped for s in self.shards])
        self._synchronized = False
        self._skip = False
        self._buckets: list[list[Shard]] = []
        self._pending: dict[int, object] = {}
        self._arrived: dict[int, int] = {}
        self._launched: set[int] = set()   # buckets reduce-scattered since the last synchronize
        if stage == 2:
            self._hook_buckets()

    # the optimizer's face
    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict):
        self.inner.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for shard in self.shards:
            shard.param.grad = None
            shard.stepped.grad = None
        self._drain(keep=False)
        self._synchronized = False

    @contextlib.contextmanager
    def skip_synchronize(self):
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def step(self) -> None:
        if not self._skip:
            self.synchronize()
        self.inner.step()
        self._synchronized = False
        if self.stage in (1, 2):
            self._gather_updated()

    # the collectives
    def synchronize(self) -> None:
        """Every rank's stepped tensors get their averaged gradient: its rows (reduce-scattered),
        or the whole (allreduced) where held whole."""
        if self._synchronized:
            return
        import horovod.torch as hvd

        if self.stage == 1:
            def start(i: int, bucket: list[Shard]):
                started = _reducescatter([self._grad(s) for s in bucket], [s.dim for s in bucket], self.dp_set,
                                         f"zero.grads.{i}", handle=True)
                for s in bucket:   # the reduction holds what it sends
                    s.param.grad = None
                return started

            cut = [s for s in self.shards if s.rows is not None]
            _one_ahead(self._by_bytes(cut), start, self._add_rows)
        elif self.stage == 2:
            # what backward left unsent: a bucket whose gradients did not all arrive (an unused
            # parameter), or part of one again after a pass of backward_passes_per_step sent it
            for b in range(len(self._buckets)):
                if b not in self._launched or self._arrived.get(b):
                    self._launch(b)
            self._drain(keep=True)
        whole = [s for s in self.shards if s.rows is None]
        if whole:
            averaged = hvd.grouped_allreduce([self._grad(s).contiguous() for s in whole], op=hvd.Average,
                                             process_set=self.dp_set, name="zero.whole_grads")
            for s, g in zip(whole, averaged):
                s.param.grad = g
        self._synchronized = True

    def _grad(self, shard: Shard) -> torch.Tensor:
        g = shard.param.grad
        return torch.zeros_like(shard.param) if g is None else g

    @staticmethod
    def _by_bytes(shards: list[Shard]) -> list[list[Shard]]:
        """`shards` in order, BUCKET_BYTES of their parameters a group."""
        return in_fusion_buffers(shards, lambda s: s.param.numel() * s.param.element_size(), BUCKET_BYTES)

    def _gather_updated(self) -> None:
        """Stages 1 and 2: every rank's updated rows all-gathered into the whole parameters, each
        bucket started before the last one is copied into place."""
        def start(i: int, bucket: list[Shard]):
            return _start_allgather([s.stepped for s in bucket], [s.dim for s in bucket], self.dp_set,
                                    f"zero.params.{i}")

        def finish(bucket: list[Shard], started) -> None:
            for s, w in zip(bucket, _gathered(started)):
                s.param.copy_(w)

        cut = [s for s in self.shards if s.rows is not None]
        with torch.no_grad():
            _one_ahead(self._by_bytes(cut), start, finish)

    # stage 2: gradients reduce-scattered as backward produces them
    def _hook_buckets(self) -> None:
        cut = [s for s in reversed(self.shards) if s.rows is not None]   # backward's order, about
        self._buckets = self._by_bytes(cut)
        for b, bucket in enumerate(self._buckets):
            for s in bucket:
                s.param.register_post_accumulate_grad_hook(functools.partial(self._arrive, b))

    def _arrive(self, b: int, param: torch.Tensor) -> None:
        self._arrived[b] = self._arrived.get(b, 0) + 1
        if self._arrived[b] == len(self._buckets[b]):
            self._launch(b)

    def _launch(self, b: int) -> None:
        """Reduce-scatter bucket `b`'s gradients and drop the whole ones (Horovod holds them until the
        reduction is done); then collect the buckets launched before it, so that one bucket of whole
        gradients at most is in flight while backward goes on."""
        if b in self._pending:   # the previous backward pass's, under backward_passes_per_step
            self._collect(b)
        bucket = self._buckets[b]
        self._pending[b] = _reducescatter([self._grad(s) for s in bucket], [s.dim for s in bucket], self.dp_set,
                                          f"zero.grads.{b}", handle=True)
        self._arrived[b] = 0
        self._launched.add(b)
        for s in bucket:
            s.param.grad = None
        for earlier in [c for c in self._pending if c != b]:
            self._collect(earlier)

    def _collect(self, b: int) -> None:
        self._add_rows(self._buckets[b], self._pending.pop(b))

    @staticmethod
    def _add_rows(bucket: list[Shard], started) -> None:
        """A started reduce-scatter's rows, into (or added to) the gradients of the tensors stepped."""
        for s, g in zip(bucket, _rows_of(started)):
            s.stepped.grad = g if s.stepped.grad is None else s.stepped.grad.add_(g)

    def _drain(self, keep: bool) -> None:
        """Wait for every reduction in flight; `keep`: add its rows to the gradients (else drop them)."""
        import horovod.torch as hvd

        for b in list(self._pending):
            if keep:
                self._collect(b)
            else:
                hvd.synchronize(self._pending.pop(b)[0][0])
        self._arrived.clear()
        self._launched.clear()

    # what clipping, the non-finite check and fp16 read
    def grad_norm(self, parameters=None) -> torch.Tensor:
        """The whole model's gradient norm: every rank's stepped gradients' squares summed over the
        job, each divided by the ranks holding the same one (a row once; a tensor held whole by
        every replica, and one tensor parallelism keeps whole by every rank of its group)."""
        import horovod.torch as hvd

        terms = [s.stepped.grad.detach().float().pow(2).sum()
                 / ((1 if id(s.param) in self.tp_split else self.tp) * (self.dp_size if s.rows is None else 1))
                 for s in self.shards if s.stepped.grad is not None]
        squares = torch.stack(terms).sum().cpu() if terms else torch.zeros((), dtype=torch.float32)
        # Horovod: every rank's share, summed over the job (the replicas and tensor-parallel groups)
        return hvd.allreduce(squares, op=hvd.Sum, name="zero.grad_norm").sqrt()

    def agree_on_overflow(self, scaler) -> None:
        """fp16: after scaler.unscale_, an overflow in any rank's rows skips the step on every rank
        of the job (a tensor-parallel group's ranks step together)."""
        import horovod.torch as hvd

        state = scaler._per_optimizer_states[id(self)]
        for device, found in state["found_inf_per_device"].items():
            found.copy_(hvd.allreduce(found.cpu(), op=hvd.Max, name=f"zero.overflow.{device}").to(found.device))

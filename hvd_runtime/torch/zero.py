"""Sharded data parallelism over the data-parallel ranks (`horovod.zero: 1 | 2 | 3`), as ZeRO shards it.

    model = shard_parameters(model, dp_set, dp_rank, dp_size)   # stage 3: on the meta model, before it is real
    optimizer = ZeroOptimizer(model, plain_optimizer, stage, dp_set)

Each of N data-parallel ranks owns a 1/N part of every parameter: its rows (dim 0), cut as
Horovod's reduce-scatter cuts a tensor (the first `rows % N` ranks one row more), so that the
averaged gradient rows a reduce-scatter hands a rank are the rows it steps. A tensor of fewer rows
than ranks (a bias of a narrow layer) is not cut: every rank keeps it whole, its gradient allreduced.

- stage 1: the optimizer state is sharded. Backward leaves the whole gradient on every rank; the
  step reduce-scatters it (averaged), each rank's optimizer steps its rows of each parameter (a
  view into the parameter, so the update lands in place) and the updated rows are all-gathered.
- stage 2: the gradients too. As backward produces them, each bucket of gradients (at most one
  Horovod fusion buffer, in backward's order) is reduce-scattered while backward goes on, and the
  whole gradients are dropped: a rank keeps only its rows, summed over backward_passes_per_step.
- stage 3: the parameters too. A rank holds only its rows; each block (hvd_runtime.torch.stage's
  blocks, and the model's own parameters outside them) all-gathers its parameters just before its
  forward, in one grouped collective, through an autograd function whose backward reduce-scatters
  the block's gradients back to the rows, again in one. The gathered tensors autograd saves for
  backward are not kept: it saves markers and gathers the block again when backward first needs
  one (or the block's recomputation does, under `model.recompute: blocks`). The model's classes
  and state_dict names are unchanged.

The global gradient norm (clipping, the non-finite check) sums each rank's rows over the set, the
whole tensors counted once; fp16's overflow verdict is the set's. Checkpoints write each rank's
rows under their whole-model names (hvd_runtime.torch.checkpoint), so any layout resumes them.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch import nn

from hvd_runtime.shards import Placement
from hvd_runtime.torch.fusion import in_fusion_buffers
from hvd_runtime.torch.meta_init import take
from hvd_runtime.torch.recompute import is_recomputed, swap_class_beneath
from hvd_runtime.torch.stage import named_blocks

__all__ = ["ZeroOptimizer", "in_lockstep", "row_range", "rows_by_parameter", "shard_parameters"]


def row_range(rows: int, rank: int, size: int) -> tuple[int, int]:
    """[start, stop) of `rank`'s rows of `rows`, as Horovod's reduce-scatter deals them out."""
    base, extra = divmod(rows, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def _cut(shape, size: int) -> bool:
    """Whether a tensor of `shape` is cut into rows over `size` ranks (each must get one)."""
    return size > 1 and len(shape) > 0 and shape[0] >= size


@dataclass
class Shard:
    """One parameter under ZeRO: its name in the whole model, whole shape, this rank's rows of it
    (None: held whole) and the tensor the optimizer steps (the rows, or the parameter when whole)."""

    name: str
    param: nn.Parameter
    shape: tuple[int, ...]
    rows: tuple[int, int] | None
    stepped: torch.Tensor

    @property
    def placement(self) -> Placement:
        return Placement.whole(self.shape) if self.rows is None else \
            Placement.slice(self.shape, 0, range(*self.rows))


# -- stage 3: each rank holds its rows; blocks gather before they run -----------------------------

def shard_parameters(model: nn.Module, dp_set, dp_rank: int, dp_size: int) -> nn.Module:
    """Stage 3, on the meta `model` (hvd_runtime.torch.meta_init): each parameter cut into rows is
    replaced by this rank's rows of it (still meta: materialize draws only them), and every block
    made to gather its parameters before it runs. Tied parameters stay one. Each module records
    which of its parameters are rows of which (`_hvd_zero_rows`): materialize makes new tensors,
    so the record is the module's, not the tensor's. Returns `model`."""
    names = {id(p): name for name, p in model.named_parameters()}
    replaced: dict[int, tuple[nn.Parameter, _Rows | None]] = {}
    for owner in model.modules():
        owner._hvd_zero_rows = {}
        for key, p in list(owner._parameters.items()):
            if p is None:
                continue
            if id(p) not in replaced:
                shape = tuple(p.shape)
                held = _Rows(names[id(p)], shape, row_range(shape[0], dp_rank, dp_size)) \
                    if _cut(shape, dp_size) else None
                replaced[id(p)] = (p if held is None else take(p, rows=slice(*held.rows)), held)
            owner._parameters[key], held = replaced[id(p)]
            if held is not None:
                owner._hvd_zero_rows[key] = held
    for _, block in named_blocks(model):
        _gathering(block, dp_set)
    _gathering(model, dp_set, own_only=True)
    return model


@dataclass(frozen=True)
class _Rows:
    """What a stage-3 parameter holds: rows [start, stop) of the whole model's `name`, of `shape`."""

    name: str
    shape: tuple[int, ...]
    rows: tuple[int, int]


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
        dp_set, name = how
        gathered = _allgather(rows, dp_set, name)
        ctx.how, ctx.shapes, ctx.device = how, [t.shape for t in gathered], rows[0].device
        return tuple(gathered)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        import horovod.torch as hvd

        dp_set, name = ctx.how
        grads = [torch.zeros(shape, device=ctx.device) if g is None else g.contiguous()
                 for g, shape in zip(grads, ctx.shapes)]
        return (None, *hvd.grouped_reducescatter(grads, op=hvd.Average, process_set=dp_set, name=f"{name}.grad"))


def _allgather(rows, dp_set, name: str) -> list[torch.Tensor]:
    """The whole tensors of `rows` (one grouped all-gather)."""
    import horovod.torch as hvd

    return hvd.grouped_allgather([t.detach().contiguous() for t in rows], process_set=dp_set, name=name)


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
    params = list({id(owner._parameters[key]): owner._parameters[key] for owner, key, _ in sharded}.values())
    name = f"zero3.{sharded[0][2].name}"
    gathered = _Gather.apply((dp_set, name), *params) if grad else _allgather(params, dp_set, name)
    full = {id(p): t for p, t in zip(params, gathered)}
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
            again["tensors"] = _allgather(params, dp_set, f"{name}.again")
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
            owner._parameters[key] = full[id(p)]
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

    def __init__(self, model: nn.Module, make_optimizer, stage: int, dp_set, dp_rank: int, dp_size: int):
        """`make_optimizer(tensors)`: the framework optimizer over the tensors to step."""
        self.stage, self.dp_set = stage, dp_set
        self.shards: list[Shard] = []
        held_rows = rows_by_parameter(model) if stage == 3 else {}
        for name, p in model.named_parameters():   # a tied parameter once, by its first name
            if stage == 3:
                held = held_rows.get(id(p))
                self.shards.append(Shard(name, p, tuple(p.shape) if held is None else held.shape,
                                         None if held is None else held.rows, p))
            elif _cut(p.shape, dp_size):
                rows = row_range(p.shape[0], dp_rank, dp_size)
                self.shards.append(Shard(name, p, tuple(p.shape), rows, p.detach()[rows[0]:rows[1]]))
            else:
                self.shards.append(Shard(name, p, tuple(p.shape), None, p))
        self.inner = make_optimizer([s.stepped for s in self.shards])
        self._synchronized = False
        self._skip = False
        self._buckets: list[list[Shard]] = []
        self._pending: dict[int, object] = {}
        self._arrived: dict[int, int] = {}
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
            cut = [s for s in self.shards if s.rows is not None]
            for i, bucket in enumerate(self._by_bytes(cut)):
                rows = hvd.grouped_reducescatter([self._grad(s) for s in bucket], op=hvd.Average,
                                                 process_set=self.dp_set, name=f"zero.grads.{i}")
                for s, g in zip(bucket, rows):
                    s.stepped.grad = g
                    s.param.grad = None
        elif self.stage == 2:
            for b in range(len(self._buckets)):
                if b not in self._pending:
                    self._launch(b)
            self._drain(keep=True)
        whole = [s for s in self.shards if s.rows is None]
        if whole:
            averaged = hvd.grouped_allreduce([self._grad(s) for s in whole], op=hvd.Average,
                                             process_set=self.dp_set, name="zero.whole_grads")
            for s, g in zip(whole, averaged):
                s.param.grad = g
        self._synchronized = True

    def _grad(self, shard: Shard) -> torch.Tensor:
        g = shard.param.grad
        return torch.zeros_like(shard.param) if g is None else g.contiguous()

    @staticmethod
    def _by_bytes(shards: list[Shard]) -> list[list[Shard]]:
        """`shards` in order, a fusion buffer's bytes of their parameters a group."""
        return in_fusion_buffers(shards, lambda s: s.param.numel() * s.param.element_size())

    def _gather_updated(self) -> None:
        """Stages 1 and 2: every rank's updated rows all-gathered into the whole parameters."""
        import horovod.torch as hvd

        cut = [s for s in self.shards if s.rows is not None]
        with torch.no_grad():
            for i, bucket in enumerate(self._by_bytes(cut)):
                whole = hvd.grouped_allgather([s.stepped.contiguous() for s in bucket], process_set=self.dp_set,
                                              name=f"zero.params.{i}")
                for s, w in zip(bucket, whole):
                    s.param.copy_(w)

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
        import horovod.torch as hvd

        if b in self._pending:   # the previous backward pass's, under backward_passes_per_step
            self._collect(b)
        bucket = self._buckets[b]
        self._pending[b] = hvd.grouped_reducescatter_async([self._grad(s) for s in bucket], op=hvd.Average,
                                                           process_set=self.dp_set, name=f"zero.grads.{b}")
        self._arrived[b] = 0
        for s in bucket:
            s.param.grad = None
        for earlier in [c for c in self._pending if c != b]:
            self._collect(earlier)

    def _collect(self, b: int) -> None:
        import horovod.torch as hvd

        for s, g in zip(self._buckets[b], hvd.synchronize(self._pending.pop(b))):
            s.stepped.grad = g if s.stepped.grad is None else s.stepped.grad.add_(g)

    def _drain(self, keep: bool) -> None:
        """Wait for every reduction in flight; `keep`: add its rows to the gradients (else drop them)."""
        import horovod.torch as hvd

        for b in list(self._pending):
            if keep:
                self._collect(b)
            else:
                hvd.synchronize(self._pending.pop(b))
        self._arrived.clear()

    # what clipping, the non-finite check and fp16 read
    def grad_norm(self, parameters=None) -> torch.Tensor:
        """The whole model's gradient norm: rows' squares summed over the set, whole tensors once."""
        import horovod.torch as hvd

        rows = [s.stepped.grad for s in self.shards if s.rows is not None and s.stepped.grad is not None]
        whole = [s.stepped.grad for s in self.shards if s.rows is None and s.stepped.grad is not None]
        squares = lambda grads: sum((g.detach().float().pow(2).sum() for g in grads),  # noqa: E731
                                    torch.zeros((), dtype=torch.float32))
        total = hvd.allreduce(squares(rows).cpu(), op=hvd.Sum, process_set=self.dp_set, name="zero.grad_norm")
        return (total + squares(whole).cpu()).sqrt()

    def agree_on_overflow(self, scaler) -> None:
        """fp16: after scaler.unscale_, an overflow in any rank's rows skips the step on every rank."""
        import horovod.torch as hvd

        state = scaler._per_optimizer_states[id(self)]
        for device, found in state["found_inf_per_device"].items():
            found.copy_(hvd.allreduce(found.cpu(), op=hvd.Max, process_set=self.dp_set,
                                      name=f"zero.overflow.{device}").to(found.device))

    def named_shards(self) -> list[tuple[str, torch.Tensor, Placement]]:
        """(name in the whole model, the tensor the optimizer steps, its Placement): what checkpoints
        write optimizer slots by."""
        return [(s.name, s.stepped, s.placement) for s in self.shards]

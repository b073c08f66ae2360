"""Pipeline links built from Horovod's collectives and torch.distributed, for PyTorch: what the
socket link (hvd_runtime.torch.p2p.SocketTensorLink, the generated projects' one) is compared
with, in bench/p2p_bench.py and bench/pipeline_bench.py, and checked against in the tests.

- `AlltoallLink`: `hvd.alltoall` inside the 2-rank process set of the pair, the sender splitting
  everything to the peer and the receiver sending an empty tensor. alltoall sizes its output from
  the sender's splits, so a message carries its own dtype and shape (a small header in front of
  the raw bytes) and costs one collective.
- `BroadcastLink`: `hvd.broadcast_` rooted at the sender inside the pair's process set. The
  receiver must allocate the exact shape first, so an unknown shape costs a header broadcast first.
- `TorchDistLink`: torch.distributed (gloo) `isend`/`recv`, a second communicator beside
  Horovod's: real p2p, but torch only and one more rendezvous to set up.

`links(name)` gives what `init_pipeline(links=)` takes (hvd_runtime.pipeline.grid.Links); None
for "socket".
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch

from hvd_runtime.pipeline.p2p_header import HEADER_WORDS, header_words, read_header_words
from hvd_runtime.pipeline.socket_link import reachable_address
from hvd_runtime.torch.p2p import DTYPES, Link

NAMES = ("socket", "alltoall", "broadcast", "torch")


def header(t: torch.Tensor) -> torch.Tensor:
    """`t`'s dtype and shape as header words, in a tensor."""
    return torch.tensor(header_words(DTYPES, t.dtype, tuple(t.shape)), dtype=torch.int64)


def read_header(h: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...]]:
    return read_header_words(DTYPES, h.tolist())


class AlltoallLink(Link):
    def __init__(self, rank: int, peer: int, process_set):
        super().__init__(rank, peer)
        import horovod.torch as hvd

        self._hvd, self._ps = hvd, process_set
        ranks = sorted(process_set.ranks) if process_set.ranks is not None else list(range(hvd.size()))
        self._n = len(ranks)
        self._peer_index = ranks.index(peer)

    def _name(self, src: int, dst: int, tag: str) -> str:
        return f"p2p.{src}>{dst}.{tag}"

    def send(self, tensor, tag, shape_known: bool = False):
        t = tensor.detach().contiguous()
        payload = torch.cat([header(t).view(torch.uint8), t.view(-1).view(torch.uint8)])
        splits = torch.zeros(self._n, dtype=torch.int32)
        splits[self._peer_index] = payload.numel()
        handle = self._hvd.alltoall_async(payload, splits, name=self._name(self.rank, self.peer, tag),
                                          process_set=self._ps)
        self._pending.append((handle, payload))

    def recv(self, tag, shape=None, dtype=None):
        empty = torch.empty(0, dtype=torch.uint8)
        splits = torch.zeros(self._n, dtype=torch.int32)
        handle = self._hvd.alltoall_async(empty, splits, name=self._name(self.peer, self.rank, tag),
                                          process_set=self._ps)
        data, _ = self._hvd.synchronize(handle)
        got_dtype, got_shape = read_header(data[:HEADER_WORDS * 8].view(torch.int64))
        return data[HEADER_WORDS * 8:].view(got_dtype).view(got_shape)

    def wait_sends(self):
        for handle, _ in self._pending:
            self._hvd.synchronize(handle)
        self._pending.clear()


class BroadcastLink(Link):
    def __init__(self, rank: int, peer: int, process_set):
        super().__init__(rank, peer)
        import horovod.torch as hvd

        self._hvd, self._ps = hvd, process_set

    def send(self, tensor, tag, shape_known: bool = False):
        t = tensor.detach().contiguous()
        name = f"p2p.{self.rank}>{self.peer}.{tag}"
        if not shape_known:
            h = header(t)
            self._pending.append((self._hvd.broadcast_async_(h, self.rank, name=name + ".h", process_set=self._ps), h))
        self._pending.append((self._hvd.broadcast_async_(t, self.rank, name=name, process_set=self._ps), t))

    def recv(self, tag, shape=None, dtype=None):
        name = f"p2p.{self.peer}>{self.rank}.{tag}"
        if shape is None:
            h = torch.empty(HEADER_WORDS, dtype=torch.int64)
            self._hvd.broadcast_(h, self.peer, name=name + ".h", process_set=self._ps)
            dtype, shape = read_header(h)
        out = torch.empty(shape, dtype=dtype)
        return self._hvd.broadcast_(out, self.peer, name=name, process_set=self._ps)

    def wait_sends(self):
        for handle, _ in self._pending:
            self._hvd.synchronize(handle)
        self._pending.clear()


class TorchDistLink(Link):
    """Needs `init_torch_distributed()` first. Tags become FIFO channels per direction."""

    def __init__(self, rank: int, peer: int):
        super().__init__(rank, peer)
        import torch.distributed as dist

        self._dist = dist

    @staticmethod
    def _channel(tag: str) -> int:
        # gloo matches (peer, tag) in FIFO order; the schedule sends each kind in recv order
        return 0 if tag.startswith("act") else 1 if tag.startswith("grad") else 2

    def send(self, tensor, tag, shape_known: bool = False):
        t = tensor.detach().cpu().contiguous()   # gloo moves host memory
        ch = self._channel(tag)
        if not shape_known:
            h = header(t)
            self._pending.append((self._dist.isend(h, self.peer, tag=ch), h))
        self._pending.append((self._dist.isend(t, self.peer, tag=ch), t))

    def recv(self, tag, shape=None, dtype=None):
        ch = self._channel(tag)
        if shape is None:
            h = torch.empty(HEADER_WORDS, dtype=torch.int64)
            self._dist.recv(h, self.peer, tag=ch)
            dtype, shape = read_header(h)
        out = torch.empty(shape, dtype=dtype)
        self._dist.recv(out, self.peer, tag=ch)
        return out

    def wait_sends(self):
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


def init_torch_distributed() -> None:
    """Start a gloo process group beside Horovod: rank 0 picks a port and tells the others."""
    import horovod.torch as hvd
    import torch.distributed as dist

    if dist.is_initialized():
        return
    addr = port = None
    if hvd.rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        addr = reachable_address()
    addr, port = hvd.broadcast_object((addr, port), root_rank=0, name="pp.rendezvous")
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=hvd.rank(), world_size=hvd.size())


@dataclass
class _Collective:
    """A link class over Horovod collectives in the pair's own process set."""

    make: type
    pairs: bool = True

    def start(self, hvd) -> None:
        pass

    def link(self, rank: int, peer: int, process_set) -> Link:
        return self.make(rank, peer, process_set)


class _TorchDistributed:
    pairs = False

    def start(self, hvd) -> None:
        init_torch_distributed()

    def link(self, rank: int, peer: int, process_set) -> Link:
        return TorchDistLink(rank, peer)


def links(name: str):
    """init_pipeline's `links` for a link by name (NAMES): None for the socket link."""
    if name not in NAMES:
        raise ValueError(f"unknown link {name!r}: choose one of {', '.join(NAMES)}")
    return {"socket": None, "alltoall": _Collective(AlltoallLink), "broadcast": _Collective(BroadcastLink),
            "torch": _TorchDistributed()}[name]

"""Point-to-point messages between two neighbouring pipeline stages, for PyTorch.

Horovod has collectives only, no send/recv. A `Link` joins this rank to one peer rank and offers
a non-blocking `send` and a blocking `recv`. `SocketTensorLink` carries torch tensors over a
connection of the pair's own (hvd_runtime.pipeline.socket_link: Unix-domain on one host, TCP
across hosts), the link the TensorFlow pipeline uses too: a tensor goes as its header words and
its host bytes. bench/p2p_links.py builds links from Horovod's collectives to compare with it.

Messages are matched by tag, so a pair may exchange activations and gradients in either order:
each side posts its sends without waiting, and the step ends with `wait_sends()`.
"""

from __future__ import annotations

import torch

from hvd_runtime.pipeline.p2p_header import header_words, read_header_words
from hvd_runtime.pipeline.socket_link import SocketLink

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.uint8, torch.int8, torch.bool]


class Link:
    """Messages between this rank and `peer`. Subclasses move the bytes."""

    def __init__(self, rank: int, peer: int):
        self.rank, self.peer = rank, peer
        self._pending: list = []

    def send(self, tensor: torch.Tensor, tag: str, shape_known: bool = False) -> None:
        """Post `tensor` to the peer without waiting. shape_known: the receiver passes shape and dtype."""
        raise NotImplementedError

    def recv(self, tag: str, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Block until the peer's message `tag` arrives. Pass shape and dtype when both sides know them."""
        raise NotImplementedError

    def wait_sends(self) -> None:
        """Wait for every posted send: call once per step, before the buffers may be reused."""
        raise NotImplementedError


class SocketTensorLink(Link):
    """torch tensors over a SocketLink: header words and the tensor's bytes, staged through the host."""

    def __init__(self, link: SocketLink):
        super().__init__(link.rank, link.peer)
        self._link = link

    def send(self, tensor, tag, shape_known: bool = False):
        t = tensor.detach().cpu().contiguous()
        self._link.send_bytes(tag, header_words(DTYPES, t.dtype, tuple(t.shape)), t.view(-1).view(torch.uint8).numpy())

    def recv(self, tag, shape=None, dtype=None):
        words, body = self._link.recv_bytes(tag)
        dtype, shape = read_header_words(DTYPES, words)
        return torch.from_numpy(body).view(dtype).view(shape)

    def wait_sends(self):
        self._link.wait_sends()


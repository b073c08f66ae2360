"""A pipeline link built from Horovod's alltoall, for TensorFlow: what the socket link
(hvd_runtime.tf.p2p.SocketTensorLink, the generated projects' one) is compared with in
bench/p2p_bench_tf.py, and checked against in the tests.

`AlltoallLink`: one `hvd.alltoall` inside the 2-rank process set of the pair (or the global set
when the pair is the whole job): the sender splits its whole payload to the peer, the receiver
contributes an empty tensor. alltoall sizes the output from the sender's splits, so the payload
carries its own dtype and shape in a small header before the raw bytes. It needs nothing beside
Horovod.

Two facts of horovod.tensorflow shape it:
- In eager mode a Horovod op ignores its `name` and ranks match their ops by call order, so two
  messages in flight at once get mixed up. Inside a tf.function the name is the graph node's and
  is honoured: every message tag gets its own traced function, and messages match by name.
- A Horovod op blocks its thread until the peer joins. A send must not block the stage (the
  peer may first need something from it), so sends run on one background thread per link, in
  the order posted; the peer receives them in that order, which the schedules guarantee. The
  step ends with `wait_sends()`.

`links(name)` gives what `init_pipeline(links=)` takes (hvd_runtime.pipeline.grid.Links); None
for "socket".
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import tensorflow as tf

from hvd_runtime.pipeline.p2p_header import HEADER_WORDS, header_words, read_header_words
from hvd_runtime.tf.compiled import compiled
from hvd_runtime.tf.p2p import DTYPES

NAMES = ("socket", "alltoall")


class _TracedOnceEach(logging.Filter):
    """Each message tag's function is traced once, by design; TF's retracing warning would say otherwise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "AlltoallLink._op" not in record.getMessage()


tf.get_logger().addFilter(_TracedOnceEach())


def encode(t: tf.Tensor) -> tf.Tensor:
    """Header + the tensor's bytes, as one flat uint8 tensor."""
    t = tf.convert_to_tensor(t)
    words = header_words(DTYPES, t.dtype, t.shape.as_list())
    header = tf.reshape(tf.bitcast(tf.constant(words, tf.int64), tf.uint8), [-1])
    body = t if t.dtype == tf.uint8 else tf.bitcast(t, tf.uint8)
    return tf.concat([header, tf.reshape(body, [-1])], axis=0)


def decode(data: tf.Tensor) -> tf.Tensor:
    words = tf.bitcast(tf.reshape(data[:HEADER_WORDS * 8], [HEADER_WORDS, 8]), tf.int64).numpy().tolist()
    dtype, shape = read_header_words(DTYPES, words)
    body = data[HEADER_WORDS * 8:]
    if dtype != tf.uint8:
        body = tf.bitcast(tf.reshape(body, [-1, dtype.size]), dtype)
    return tf.reshape(body, shape)


class AlltoallLink:
    """Messages between this rank and `peer` inside `process_set` (which holds both)."""

    def __init__(self, rank: int, peer: int, process_set):
        import horovod.tensorflow as hvd

        self.rank, self.peer = rank, peer
        self._hvd, self._ps = hvd, process_set
        ranks = sorted(process_set.ranks) if process_set.ranks is not None else list(range(hvd.size()))
        self._n, self._peer_index = len(ranks), ranks.index(peer)
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"p2p-{rank}>{peer}")
        self._pending: list[Future] = []
        self._ops: dict[str, tf.types.experimental.GenericFunction] = {}

    def _op(self, name: str):
        """The traced alltoall named `name` (see the module docstring: eager ops lose their names)."""
        if name not in self._ops:
            hvd, ps = self._hvd, self._ps

            @compiled(input_signature=[tf.TensorSpec([None], tf.uint8), tf.TensorSpec([self._n], tf.int32)])
            def exchange(payload, splits):
                return hvd.alltoall(payload, splits=splits, name=name, ignore_name_scope=True, process_set=ps)[0]

            self._ops[name] = exchange
        return self._ops[name]

    def _exchange(self, payload: tf.Tensor, count: int, name: str) -> tf.Tensor:
        splits = [0] * self._n
        splits[self._peer_index] = count
        return self._op(name)(payload, tf.constant(splits, tf.int32))

    def send(self, tensor, tag: str, shape_known: bool = False) -> None:
        """Post `tensor` to the peer without waiting (every message carries its header)."""
        payload = encode(tensor)
        name = f"p2p_{self.rank}_to_{self.peer}_{tag}"
        self._pending.append(self._sender.submit(self._exchange, payload, int(payload.shape[0]), name))

    def recv(self, tag: str, shape=None, dtype=None) -> tf.Tensor:
        """Block until the peer's message `tag` arrives."""
        data = self._exchange(tf.zeros([0], tf.uint8), 0, f"p2p_{self.peer}_to_{self.rank}_{tag}")
        return decode(data)

    def wait_sends(self) -> None:
        """Wait for every posted send (and raise its error, if any)."""
        for future in self._pending:
            future.result()
        self._pending.clear()


class _Alltoall:
    pairs = True

    def start(self, hvd) -> None:
        pass

    def link(self, rank: int, peer: int, process_set) -> AlltoallLink:
        return AlltoallLink(rank, peer, process_set)


def links(name: str):
    """init_pipeline's `links` for a link by name (NAMES): None for the socket link."""
    if name not in NAMES:
        raise ValueError(f"unknown link {name!r}: choose one of {', '.join(NAMES)}")
    return None if name == "socket" else _Alltoall()

"""Point-to-point messages between two neighbouring pipeline stages, for TensorFlow.

`SocketTensorLink` carries TensorFlow tensors over a connection of the pair's own
(hvd_runtime.pipeline.socket_link: Unix-domain on one host, TCP across hosts): a tensor goes as its
header words and its host bytes, with no Horovod on the way. Its interface is the torch links'
(`send` non-blocking, `recv` blocking, `wait_sends` once a step). bench/p2p_links_tf.py builds a
link from Horovod's alltoall to compare with it (docs/pipeline.md).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from hvd_runtime.pipeline.p2p_header import header_words, read_header_words
from hvd_runtime.pipeline.socket_link import SocketLink

DTYPES = [tf.float32, tf.float64, tf.float16, tf.bfloat16, tf.int64, tf.int32, tf.uint8, tf.int8]


class SocketTensorLink:
    """TensorFlow tensors over a SocketLink: header words and the tensor's bytes, copied to the host."""

    def __init__(self, link: SocketLink):
        self.rank, self.peer, self._link = link.rank, link.peer, link

    def send(self, tensor, tag: str, shape_known: bool = False) -> None:
        """Post `tensor` to the peer without waiting (the header is a few words: always sent)."""
        tensor = tf.convert_to_tensor(tensor)
        array = np.ascontiguousarray(tensor.numpy())
        self._link.send_bytes(tag, header_words(DTYPES, tensor.dtype, array.shape), array.reshape(-1).view(np.uint8))

    def recv(self, tag: str, shape=None, dtype=None) -> tf.Tensor:
        """Block until the peer's message `tag` arrives."""
        words, body = self._link.recv_bytes(tag)
        dtype, shape = read_header_words(DTYPES, words)
        return tf.convert_to_tensor(body.view(dtype.as_numpy_dtype).reshape(shape))

    def wait_sends(self) -> None:
        self._link.wait_sends()

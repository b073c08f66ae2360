"""Point-to-point messages between two neighbouring pipeline stages over one connection of their own.

Horovod has collectives only. Carried by a Horovod collective, a message waits for Horovod's
background loop and its coordinator's negotiation: milliseconds each on a busy host, and a
pipeline sends 2m of them per stage per step. Here each neighbour pair instead keeps one socket
connection of its own, set up once through Horovod's object collectives: every rank announces an
address, a random key comes from rank 0, each stage connects to the next, and
`multiprocessing.connection`'s HMAC handshake proves the key. Two stages in one network namespace
of one running kernel (the ranks of one host, the usual case: a node's GPUs) connect through a
Unix-domain socket in Linux's abstract namespace, which skips TCP/IP (`bench/p2p_bench.py`
compares the two; docs/pipeline.md) and leaves no file behind. Stages
on different hosts, or in different network namespaces of one, connect over TCP. From then on a message is a
fixed-size frame (header words, body length, tag length), the tag, and the body's raw bytes
received straight into their final buffer; nothing is ever unpickled.

Framework-free: a message is a tag, header words (hvd_runtime.pipeline.p2p_header) and a body of raw
bytes; the torch and TensorFlow links turn tensors into those. Sends run on one background
thread per link, in the order posted, so `send` never blocks the stage; messages of one
direction arrive in that order, which the schedules rely on, and `recv` checks the tag to prove it.
"""

from __future__ import annotations

import os
import re
import socket
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

import numpy as np

from hvd_runtime.pipeline.p2p_header import HEADER_WORDS

_FRAME = struct.Struct(f"<{HEADER_WORDS}qQH")   # header words, body bytes, tag bytes; then the tag, the body
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)    # a send that takes what fits now and never blocks (Linux, macOS)


class MessageOrderError(RuntimeError):
    """A message arrived that is not the one the schedule expects next: the stages disagree on their schedule."""


class SocketLink:
    """Messages between this rank and `peer` over a connected socket."""

    def __init__(self, rank: int, peer: int, sock: socket.socket):
        self.rank, self.peer, self._sock = rank, peer, sock
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # a small frame goes at once
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"p2p-{rank}>{peer}")
        self._pending: list[Future] = []

    def send_bytes(self, tag: str, header: list[int], body) -> None:
        """Post one message without waiting. `body` (a buffer) must stay unchanged until `wait_sends`.

        When no earlier send is still under way, the calling thread first hands the kernel what
        its socket buffer takes at once (a non-blocking sendmsg: a small message goes whole);
        only what is left goes to the sender thread. A message handed to a thread waits for that
        thread to get the GIL, up to Python's switch interval while the stage runs Python code,
        so the stage's next neighbour would wait that long. Order is kept: the thread is idle, and
        whatever it is given goes out before anything posted later.
        """
        body = memoryview(body).cast("B")
        name = tag.encode()
        frame = _FRAME.pack(*header, body.nbytes, len(name)) + name
        if _DONTWAIT and all(future.done() for future in self._pending):
            try:
                sent = self._sock.sendmsg([frame, body] if body.nbytes else [frame], [], _DONTWAIT)
            except (BlockingIOError, InterruptedError):
                sent = 0
            if sent == len(frame) + body.nbytes:
                return
            frame, body = (frame[sent:], body) if sent < len(frame) else (b"", body[sent - len(frame):])
        self._pending.append(self._sender.submit(self._send, frame, body))

    def _send(self, frame: bytes, body: memoryview) -> None:
        if frame:
            self._sock.sendall(frame)
        if body.nbytes:
            self._sock.sendall(body)

    def _recv_into(self, buffer) -> None:
        view = memoryview(buffer).cast("B")
        while view.nbytes:
            got = self._sock.recv_into(view)
            if not got:
                raise ConnectionError(f"rank {self.peer} closed its link to rank {self.rank} (did it stop?)")
            view = view[got:]

    def recv_bytes(self, tag: str) -> tuple[list[int], np.ndarray]:
        """Block until the peer's next message arrives; it must be `tag`. Returns (header words, body as uint8)."""
        frame = bytearray(_FRAME.size)
        self._recv_into(frame)
        *header, nbytes, name_bytes = _FRAME.unpack(frame)
        name = bytearray(name_bytes)
        self._recv_into(name)
        if name.decode() != tag:
            raise MessageOrderError(f"rank {self.rank} expected message {tag!r} from rank {self.peer}, "
                                    f"got {name.decode()!r}")
        body = np.empty(nbytes, np.uint8)     # filled by the socket, never zeroed first
        self._recv_into(body)
        return header, body

    def wait_sends(self) -> None:
        """Wait for every posted send (and raise its error, if any): once per step, before buffers are reused."""
        for future in self._pending:
            future.result()
        self._pending.clear()

    def close(self) -> None:
        self.wait_sends()
        self._sender.shutdown()
        self._sock.close()


def reachable_address() -> str:
    """This host's address on the route to the launcher, which every rank reaches.

    gethostname() alone may resolve to a loopback alias (127.0.1.1, as Debian and Ubuntu write
    /etc/hosts) that other hosts cannot reach. The launcher is horovodrun's rendezvous server
    with Gloo, and mpirun with MPI (OpenMPI tells each rank its address in OMPI_MCA_orte_hnp_uri,
    `<job>;tcp://<address>:<port>;...`).
    """
    target = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    if not target:
        found = re.search(r"tcp://([0-9.]+):", os.environ.get("OMPI_MCA_orte_hnp_uri", ""))
        target = found.group(1) if found else None
    if target:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))   # UDP: no packet is sent, the kernel only picks the route
            return s.getsockname()[0]
    return socket.gethostbyname(socket.gethostname())


def same_kernel_key() -> str | None:
    """Equal on two ranks exactly when they can reach each other's abstract Unix sockets: one boot of
    one kernel, one network namespace (a container or a test's namespace is another host here).
    None where there is no /proc to tell (not Linux): such ranks always use TCP."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        netns = os.stat("/proc/self/ns/net")
    except OSError:
        return None
    return f"{boot}:{netns.st_dev}:{netns.st_ino}"


def _socket_of(conn: Connection) -> socket.socket:
    """The connection's socket, to be read and written directly: the handshake is all it was for."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    conn.close()
    return sock


def connect_neighbours(hvd, prev: int | None, next_: int | None,
                       unix: bool = True) -> tuple[SocketLink | None, SocketLink | None]:
    """Links to the previous and next stage's ranks (None where there is none). Every rank must call it.
    unix=False: TCP even between the ranks of one host (bench/p2p_bench.py compares the two).

    `hvd` is horovod.torch or horovod.tensorflow (initialised): their object collectives carry the
    addresses and the key. A rank listens for its previous stage and connects to its next; the
    chain of stages has no cycle, and accepting on a thread lets both happen in any order. The
    connecting rank names itself first, so a link is only ever made with the rank meant.
    """
    rank = hvd.rank()
    key = hvd.broadcast_object(os.urandom(32) if rank == 0 else None, root_rank=0, name="p2p.key")
    kernels = hvd.allgather_object(same_kernel_key(), name="p2p.kernels")
    listener = address = None
    if prev is not None and unix and kernels[rank] is not None and kernels[rank] == kernels[prev]:
        address = f"\0hvdgen-p2p-{os.urandom(12).hex()}"   # Linux's abstract namespace: no file to clean up
        listener = Listener(address, "AF_UNIX", authkey=key)
    elif prev is not None:
        listener = Listener(("", 0), authkey=key)
        address = (reachable_address(), listener.address[1])
    addresses = hvd.allgather_object(address, name="p2p.addresses")   # a str: Unix, a pair: TCP

    accepted: list = []

    def accept() -> None:
        try:
            conn = listener.accept()
            peer = struct.unpack("<q", conn.recv_bytes())[0]
            if peer != prev:
                raise ConnectionError(f"rank {rank} expected its previous stage, rank {prev}, to connect; rank {peer} did")
            accepted.append(conn)
        except BaseException as error:  # handed to the main thread below
            accepted.append(error)

    acceptor = threading.Thread(target=accept, name=f"p2p-accept-{rank}") if listener else None
    if acceptor:
        acceptor.start()
    next_link = None
    if next_ is not None:
        peer_address = addresses[next_]
        conn = Client(peer_address if isinstance(peer_address, str) else tuple(peer_address), authkey=key)
        conn.send_bytes(struct.pack("<q", rank))
        next_link = SocketLink(rank, next_, _socket_of(conn))
    prev_link = None
    if acceptor:
        acceptor.join()
        listener.close()
        if isinstance(accepted[0], BaseException):
            raise accepted[0]
        prev_link = SocketLink(rank, prev, _socket_of(accepted[0]))
    return prev_link, next_link

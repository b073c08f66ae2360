"""The pipeline's socket link on real TCP and Unix-domain connections, without Horovod: what a stage relies on."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from hvd_runtime.pipeline.socket_link import MessageOrderError, SocketLink, same_kernel_key


@pytest.fixture(params=["tcp", "unix"])
def pair(request):
    """Two linked ends, as two neighbouring stages hold them: over loopback TCP (stages on two hosts)
    and over a Unix-domain socket (stages on one host)."""
    if request.param == "tcp":
        with socket.create_server(("127.0.0.1", 0)) as server:
            a = socket.create_connection(server.getsockname())
            b, _ = server.accept()
    else:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    first, second = SocketLink(0, 1, a), SocketLink(1, 0, b)
    yield first, second
    first.close()
    second.close()


def test_messages_arrive_whole_and_in_order(pair):
    first, second = pair
    bodies = [np.arange(n, dtype=np.uint8) for n in (0, 1, 5000, 3 << 20)]
    for i, body in enumerate(bodies):
        first.send_bytes(f"act{i}", [i, 1, body.size] + [0] * 7, body)
    for i, body in enumerate(bodies):
        header, got = second.recv_bytes(f"act{i}")
        assert header[:3] == [i, 1, body.size]
        assert got.flags.writeable and np.array_equal(got, body)
    first.wait_sends()


def test_both_sides_sending_large_messages_at_once_do_not_block_each_other(pair):
    """1F1B has each neighbour send before it receives; sends must not wait for the reader."""
    big = np.ones(32 << 20, np.uint8)    # far more than the kernel's socket buffers hold
    got = {}

    def other_side():
        pair[1].send_bytes("grad0", [0] * 10, big)
        got["act"] = pair[1].recv_bytes("act0")[1]
        pair[1].wait_sends()

    thread = threading.Thread(target=other_side)
    thread.start()
    pair[0].send_bytes("act0", [0] * 10, big)
    assert pair[0].recv_bytes("grad0")[1].sum() == big.size
    pair[0].wait_sends()
    thread.join(timeout=60)
    assert got["act"].sum() == big.size


def test_a_message_out_of_schedule_order_is_an_error_naming_both(pair):
    first, second = pair
    first.send_bytes("grad3", [0] * 10, b"x")
    with pytest.raises(MessageOrderError, match="rank 1 expected message 'act3' from rank 0, got 'grad3'"):
        second.recv_bytes("act3")


def test_a_peer_that_went_away_is_an_error_not_a_hang(pair):
    first, second = pair
    first.close()
    with pytest.raises(ConnectionError, match="rank 0 closed its link to rank 1"):
        second.recv_bytes("act0")


def test_small_messages_leave_at_once_and_big_ones_keep_their_place(pair):
    """A small message goes from the calling thread (no wait for the sender thread to get the
    GIL); one too big for the socket buffer leaves its rest to the thread, and every message
    posted after it waits its turn behind it."""
    first, second = pair
    first.send_bytes("act0", [0] * 10, np.full(64, 7, np.uint8))
    assert first._pending == []              # nothing left for the sender thread
    sizes = [32 << 20, 3, 5000, 16 << 20, 1]
    for i, n in enumerate(sizes, start=1):
        first.send_bytes(f"act{i}", [i] + [0] * 9, np.full(n, i, np.uint8))
    got = {}

    def read():
        for i in range(len(sizes) + 1):
            header, body = second.recv_bytes(f"act{i}")
            got[i] = (header[0], body.size, set(np.unique(body).tolist()))

    reader = threading.Thread(target=read)
    reader.start()
    first.wait_sends()
    reader.join(timeout=60)
    assert got[0] == (0, 64, {7})
    assert [got[i] for i in range(1, len(sizes) + 1)] == [(i, n, {i % 256}) for i, n in enumerate(sizes, start=1)]


KEY_OF_A_CHILD = [sys.executable, "-c", "from hvd_runtime.pipeline.socket_link import same_kernel_key as k; print(k())"]


def test_ranks_share_a_kernel_key_exactly_where_a_unix_socket_reaches():
    """Same host and network namespace: the same key (the stages link over a Unix socket). Another
    network namespace, as a container or the multi-host tests' hosts have: another key (TCP)."""
    here = same_kernel_key()
    assert here is not None
    assert subprocess.run(KEY_OF_A_CHILD, capture_output=True, text=True, check=True).stdout.strip() == here
    if shutil.which("unshare") is None:
        pytest.skip("no unshare to make a network namespace")
    other = subprocess.run(["unshare", "--net", *KEY_OF_A_CHILD], capture_output=True, text=True)
    if other.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {other.stderr.strip()}")
    assert other.stdout.strip() not in ("", "None", here)

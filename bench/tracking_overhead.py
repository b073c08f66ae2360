"""What tracking costs the training loop, measured side by side in one run (no asserts: numbers).

    python bench/tracking_overhead.py              # about 30 s on 2 CPU cores
    python bench/tracking_overhead.py --calls 2000

(a) `log_metrics` per call: the NullTracker (other ranks), a Tracker whose server is dead
    (records go to the spool), and one whose server accepts but never answers (records wait in
    the queue), in the same process, one after the other;
(b) `close(timeout=T)` against that hung server: how long past T it really takes to give up.
The tests check the behaviour these numbers come from (calls never wait on the server, close
gives up on its timeout); the timings live here because a shared machine makes any bound on
them a flaky test.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def hung_server() -> tuple[socket.socket, str]:
    """Accepts connections and never answers (the connections are kept open in a list)."""
    sock = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept():
        while True:
            try:
                held.append(sock.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


def dead_uri() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def per_call_us(tracker, calls: int) -> float:
    start = time.perf_counter()
    for step in range(calls):
        tracker.log_metrics({"train/loss": float(step), "train/accuracy": 0.5}, step=step)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--close-timeout", type=float, default=2.0)
    args = parser.parse_args()
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "3600")   # the hung server must stay hung

    with tempfile.TemporaryDirectory(prefix="tracking-bench-", ignore_cleanup_errors=True) as tmp:
        os.chdir(tmp)
        rows, close_s = measure(args)
        os.chdir("/")
    print(f"log_metrics, {args.calls} calls each, µs per call (ratio to NullTracker):")
    for name, us in rows:
        print(f"  {name:34s} {us:9.2f}  x{us / rows[0][1]:.0f}")
    print(f"close(timeout={args.close_timeout:g}) against a hung server: {close_s:.2f} s "
          f"({close_s / args.close_timeout:.2f} x the timeout)")


def measure(args) -> tuple[list[tuple[str, float]], float]:
    from hvd_runtime.config import load_config
    from hvd_runtime.tracking import NullTracker, start_tracking

    def tracker(uri: str, name: str):   # each in its own run dir, so each has its own spool
        config = load_config(overrides=[f"run_dir=runs/{name}"])
        return start_tracking(config, rank=0, world_size=2, framework="torch", strategy="data",
                              project_name="bench", tracking_uri=uri)

    sock, hung_uri = hung_server()
    dead, hung = tracker(dead_uri(), "dead"), tracker(hung_uri, "hung")
    dead._sender.ready.wait(120)      # the dead server has been found dead: from here on calls spool
    rows = [("NullTracker (ranks > 0)", per_call_us(NullTracker(), args.calls)),
            ("Tracker, dead server (spooled)", per_call_us(dead, args.calls)),
            ("Tracker, hung server (queued)", per_call_us(hung, args.calls))]
    dead.close()
    start = time.perf_counter()
    hung.close(timeout=args.close_timeout)
    close_s = time.perf_counter() - start
    sock.close()
    return rows, close_s


if __name__ == "__main__":
    main()

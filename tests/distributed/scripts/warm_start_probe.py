"""What a rank can see of how it was started, and what it computes; written to OUT/rank<N>.json.

usage: horovodrun -np 2 ... python warm_start_probe.py torch|tensorflow OUT
tests/distributed/test_warm_start.py runs it from a cold interpreter and from the warm start and
compares the two.
"""

import io
import json
import os
import resource
import signal
import sys
import threading

framework, out = sys.argv[1], sys.argv[2]
if framework == "torch":
    import numpy as np
    import torch

    import horovod.torch as hvd
else:
    import hvd_runtime.tf  # noqa: F401  first, as a generated train.py
    import numpy as np
    import tensorflow as tf

    import horovod.tensorflow as hvd
at_start = {"threads": len(os.listdir("/proc/self/task")), "python_threads": threading.active_count()}
unseeded_draw = np.random.random()   # numpy's global generator, before anything seeds it
hvd.init()


def stream(s: io.TextIOWrapper) -> dict:
    return {"fileno": s.fileno(), "isatty": s.isatty(), "encoding": s.encoding, "errors": s.errors,
            "line_buffering": s.line_buffering, "write_through": s.write_through, "mode": s.mode, "name": s.name,
            "buffer": type(s.buffer).__name__, "closefd": s.buffer.raw.closefd if hasattr(s.buffer, "raw") else None}


def handler(signum: int) -> str:
    h = signal.getsignal(signum)
    return h.name if isinstance(h, signal.Handlers) else getattr(h, "__name__", repr(h))


def main_module() -> dict:
    main = sys.modules["__main__"]
    return {"file": main.__file__, "name": main.__name__, "spec": repr(main.__spec__), "package": main.__package__,
            "loader": type(main.__loader__).__name__, "cached": main.__cached__,
            "builtins": getattr(main.__builtins__, "__name__", "dict")}


rank = hvd.rank()
if framework == "torch":
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    x = torch.arange(8.0).reshape(2, 4) + rank
    loss = model(x).pow(2).mean()
    loss.backward()
    grads = [hvd.allreduce(p.grad, name=f"g{i}").tolist() for i, p in enumerate(model.parameters())]
    results = {"loss": loss.item(), "grads": grads, "intra_op_threads": torch.get_num_threads(),
               "interop_threads": torch.get_num_interop_threads()}
else:
    tf.keras.utils.set_random_seed(0)   # Python's, numpy's and TensorFlow's: Keras 3 initialisers draw from all
    layer = tf.keras.layers.Dense(2, kernel_initializer="glorot_uniform")
    x = tf.reshape(tf.range(8.0), (2, 4)) + rank
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(layer(x) ** 2)
    grads = [hvd.allreduce(g, name=f"g{i}").numpy().tolist() for i, g in enumerate(tape.gradient(loss, layer.variables))]
    results = {"loss": float(loss), "grads": grads,
               "inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
               "intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
               "keras_has_sklearn_wrappers": hasattr(tf.keras, "wrappers") and "sklearn" in sys.modules}
results["numpy_draws_differ_by_rank"] = hvd.allgather_object(unseeded_draw)

print(f"rank {rank} says hello")
print(f"rank {rank} warns", file=sys.stderr)
report = {
    "environ": dict(os.environ), "argv": sys.argv, "orig_argv": [os.path.basename(sys.orig_argv[0]), *sys.orig_argv[1:]],
    "executable": sys.executable, "prefix": sys.prefix, "path": sys.path, "flags": list(sys.flags),
    "cwd": os.getcwd(), "main": main_module(), "umask": os.umask(0o22),
    "rlimits": {name: resource.getrlimit(getattr(resource, name)) for name in dir(resource) if name.startswith("RLIMIT_")},
    "signals": {signal.Signals(s).name: handler(s) for s in signal.valid_signals()
                if s < signal.SIGRTMIN and s not in (signal.SIGKILL, signal.SIGSTOP)},
    "blocked": sorted(signal.Signals(s).name for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "streams": {name: stream(getattr(sys, name)) for name in ("stdin", "stdout", "stderr")},
    "dunder_streams_are_streams": all(getattr(sys, f"__{n}__") is getattr(sys, n)
                                      for n in ("stdin", "stdout", "stderr")),
    "at_start": at_start, "parent": open(f"/proc/{os.getppid()}/cmdline", "rb").read().decode().split("\0"),
    "modules": sorted(sys.modules), "results": results,
    "recursion_limit": sys.getrecursionlimit(), "switch_interval": sys.getswitchinterval(),
    "warnings_filters": [repr(f) for f in __import__("warnings").filters],
}
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(report, f, indent=1, sort_keys=True)

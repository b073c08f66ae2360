"""TensorFlow's native start-up notices, kept out of every rank's output.

`import tensorflow` (2.21) writes, from C++ and twice over (its two native libraries), a notice
that logging is not initialised, that oneDNN is on, that no CUDA driver was found and which CPU
instructions it was not built for; on a host with no GPU, its first device query adds
"E... failed call to cuInit: ... UNKNOWN ERROR (303)". A generated project's 2-rank CPU job
printed 18 such lines before its first line of its own, two of them errors that are none.
TF_CPP_MIN_LOG_LEVEL does not silence them (measured at 2; tensorflow/tensorflow#100442).

So the import and the first device query run with the process's stderr (file descriptor 2, where
C++ writes) going through `grep -v`, which passes on everything but the lines that are exactly
those notices (NOTICES): a real error, a warning, Python's own output come through, in order (the
block ends when grep has written all it was given). A separate process, so that if the block
dies, a fatal message still gets out. The cuInit failure is dropped only where the host has no
NVIDIA device at all (no /dev/nvidiactl): on a GPU host it is the message that explains why the
GPU is not used. `TF_CPP_MIN_LOG_LEVEL=0` in the environment shows everything, unfiltered; so
does a host without grep.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# POSIX extended regular expressions (grep -E), which Python's re reads alike
_NATIVE = r"^[IWE][0-9]{4} [0-9:.]+ +[0-9]+ "   # absl's prefix: severity, date, time, thread id
NOTICES = (
    r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$",
    _NATIVE + r"port\.cc:[0-9]+\] oneDNN custom operations are on\. ",
    _NATIVE + r"cudart_stub\.cc:[0-9]+\] Could not find cuda drivers on your machine, GPU will not be used\.$",
    _NATIVE + r"cpu_feature_guard\.cc:[0-9]+\] This TensorFlow binary is optimized to use available CPU instructions",
    r"^To enable the following instructions: [A-Z0-9_ ]+, in other operations, rebuild TensorFlow with the "
    r"appropriate compiler flags\.$",
)
NO_GPU_NOTICE = _NATIVE + r"cuda_platform\.cc:[0-9]+\] failed call to cuInit: "


def host_has_nvidia_device(dev: Path = Path("/dev")) -> bool:
    return (dev / "nvidiactl").exists() or any(dev.glob("nvidia[0-9]*"))


def notices(gpu_host: bool) -> tuple[str, ...]:
    """The patterns of the lines dropped on this kind of host."""
    return NOTICES if gpu_host else (*NOTICES, NO_GPU_NOTICE)


@contextmanager
def quiet_native_notices() -> Iterator[None]:
    """Run the block with stderr passing through `grep -v` of the notices; return once grep is done."""
    grep = shutil.which("grep")
    if os.environ.get("TF_CPP_MIN_LOG_LEVEL") == "0" or grep is None:
        yield
        return
    expressions = [arg for pattern in notices(host_has_nvidia_device()) for arg in ("-e", pattern)]
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:   # no stderr at all (closed): nothing to filter
        yield
        return
    try:
        # stdout: this process's stderr as it was; grep's exit status (1: it passed no line) is of no interest
        sieve = subprocess.Popen([grep, "-a", "-v", "-E", *expressions], stdin=subprocess.PIPE, stdout=saved)
    except OSError:
        os.close(saved)
        yield
        return
    os.dup2(sieve.stdin.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        sieve.stdin.close()
        try:
            sieve.wait(timeout=10)
        except subprocess.TimeoutExpired:   # a process the block started holds the pipe: grep serves it on
            pass

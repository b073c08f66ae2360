"""SIGTERM and SIGHUP unwind a command like Ctrl-C, so its `finally` blocks remove what it made.

A command that writes through a temporary folder (`hvdgen new`, `hvdgen k8s`) wraps its work in
`interrupts_unwind()` and its clean-up in `interrupts_held()`, so a killed terminal or a CI
timeout leaves no hidden folder behind, and a second signal cannot cut the clean-up short.
"""

from __future__ import annotations

import signal
from contextlib import contextmanager

_CLEAN_UP_ON = (signal.SIGTERM, signal.SIGHUP)


def _interrupted(signum, _frame):
    raise SystemExit(128 + signum)


@contextmanager
def interrupts_unwind():
    """SIGTERM and SIGHUP unwind like Ctrl-C, so `finally` removes the temporary folders."""
    previous = {sig: signal.signal(sig, _interrupted) for sig in _CLEAN_UP_ON}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def interrupts_held():
    """Hold signals while cleaning up, so a second one cannot leave a half-removed folder."""
    held = {signal.SIGINT, *_CLEAN_UP_ON}
    signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)

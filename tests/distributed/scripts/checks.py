"""What every numerical check script prints, on rank 0, once all ranks have judged a check."""

import sys


def report(hvd, name: str, ok: bool, detail: str = "") -> None:
    """`OK name` when the check holds on every rank, else `FAIL name` and exit 1 everywhere.

    hvd: horovod.torch or horovod.tensorflow, whichever the script runs on.
    """
    oks = hvd.allgather_object(bool(ok), name=f"ok_{name}")
    if hvd.rank() == 0:
        print(("OK " if all(oks) else "FAIL ") + name + (f" ({detail})" if detail else ""), flush=True)
    if not all(oks):
        sys.exit(1)

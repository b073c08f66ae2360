"""Non-finite updates: skipped, or the run stopped, on every rank alike (`train.on_nonfinite`).

A NaN or an inf in one rank's loss or gradients is, once allreduced, in every replica's averaged
gradients; an update made of them puts it in every weight and every later checkpoint. So each
update is checked before it is applied. The loss folds into the gradients (each framework's
step multiplies it by `1` where it is finite and NaN where not, so a non-finite loss makes every
gradient NaN), and the check reads the global gradient norm after the allreduce: the same number
on every rank (summed over the stages and the tensor slices where a rank holds part of the
model), so every rank decides alike, and data parallelism needs no collective of its own.

    skip: the update is dropped, the optimizer's state with it, and training goes on; more than
          train.max_skipped in a row and the run stops, as with stop
    stop: the run ends at that step, before its update, with one line: the weights and the
          newest checkpoint are the last good ones
    off:  no check

Under fp16 the loss scaler skips an overflowed update itself (and lowers its scale): a scaled
gradient overflows now and then by design, so there the scaler decides, not this check.
"""

from __future__ import annotations

import sys
from typing import Callable

__all__ = ["POLICIES", "Guard", "NonFinite", "nonfinite_guard"]

POLICIES = ("skip", "stop", "off")


class NonFinite(SystemExit):
    """The run stopped at an update that was not finite: exit status 1, the MLflow run FAILED."""

    run_status = "FAILED"

    def __init__(self, step: int):
        super().__init__(1)
        self.step = step


class Guard:
    """`allows(finite, step)`: whether the update of `step` is applied; raises NonFinite to stop."""

    def __init__(self, policy: str = "skip", max_skipped: int = 5, is_root: Callable[[], bool] = lambda: True):
        """`is_root()`: whether this process is rank 0 now (an elastic job's rank 0 may change)."""
        self.policy, self.max_skipped, self.is_root = policy, max_skipped, is_root
        self.in_a_row = 0
        self.skipped = 0    # updates skipped in this process

    @property
    def checks(self) -> bool:
        return self.policy != "off"

    def allows(self, finite: bool, step: int) -> bool:
        if finite:
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        self.skipped += 1
        if self.policy == "stop" or self.in_a_row > self.max_skipped:
            why = ("train.on_nonfinite stop" if self.policy == "stop"
                   else f"{self.in_a_row} in a row, more than train.max_skipped {self.max_skipped}")
            self._say(f"nonfinite: the gradients of step {step} are not finite (NaN or inf in the loss or the "
                      f"gradients; {why}): stopping before its update, so the weights and the newest checkpoint are "
                      f"the last good ones")
            raise NonFinite(step)
        self._say(f"nonfinite: the gradients of step {step} are not finite: its update skipped on every rank "
                  f"({self.in_a_row} in a row; train.max_skipped {self.max_skipped})")
        return False

    def _say(self, line: str) -> None:
        if self.is_root():
            print(line, file=sys.stderr, flush=True)


def nonfinite_guard(cfg, ctx) -> Guard:
    """The run's guard, from cfg.train; rank 0 of `ctx` says what it does."""
    return Guard(cfg.train.on_nonfinite, cfg.train.max_skipped, lambda: ctx.is_root)

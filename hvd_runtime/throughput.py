"""Training speed as people quote it: samples (or tokens) per second over the whole job, step time, MFU.

Framework-free. Rates are measured between log points on this rank's clock and count every
rank's samples: all ranks step together (each step ends in an allreduce), so one rank's clock
times the job. Reading a metric back from the device at a log point (the averaged loss) waits for
the queued GPU work, so the interval is the real one, not the time it took to queue kernels.
"""

from __future__ import annotations

import time


class Throughput:
    """`utilization` (hvd_runtime.mfu, rank 0's): each rate then comes with its `mfu`."""

    def __init__(self, samples_per_step: int, tokens_per_sample: int = 1, utilization=None):
        self.samples_per_step, self.tokens_per_sample = samples_per_step, tokens_per_sample
        self.utilization = utilization
        self.restart()

    def restart(self) -> None:
        self._since, self._steps = time.perf_counter(), 0
        self._epoch_since, self._epoch_steps = self._since, 0

    def step(self) -> None:
        self._steps += 1
        self._epoch_steps += 1

    def _rates(self, seconds: float, steps: int) -> dict[str, float]:
        if not steps or seconds <= 0:
            return {}
        samples = steps * self.samples_per_step / seconds
        rates = {"samples_per_s": samples, "step_time_ms": 1000.0 * seconds / steps}
        if self.tokens_per_sample > 1:  # a language model: the figure people compare is tokens per second
            rates["tokens_per_s"] = samples * self.tokens_per_sample
        if self.utilization is not None:
            rates["mfu"] = self.utilization.of(samples)
        return rates

    def since_last(self) -> dict[str, float]:
        """Rates since the previous call (or the start); then starts a new interval."""
        now = time.perf_counter()
        rates = self._rates(now - self._since, self._steps)
        self._since, self._steps = now, 0
        return rates

    def epoch(self) -> dict[str, float]:
        """Rates over the whole epoch so far (training steps only, evaluation excluded)."""
        return self._rates(time.perf_counter() - self._epoch_since, self._epoch_steps)

"""Model FLOPs utilisation (MFU): the share of the hardware's peak that a run's training uses.

    MFU = model FLOPs a sample x the job's samples per second / the job's peak FLOP/s

Model FLOPs are the model's arithmetic, not the kernels that ran: three times a forward pass
(backward computes the gradients of the inputs and of the weights, each as much as the forward),
the convention of PaLM, nanoGPT and torchtitan, so recomputed activations earn no credit. A GPT
counts 6N + 12·L·d·T a token (N its parameters less the position embedding, L blocks of width d,
T the context: the attention's scores and weighted sums); other models count one forward with
the framework's own counter (hvd_runtime.<framework>.flops). The peak: each device's dense peak
at the run's precision, from a table of NVIDIA GPUs by name; on a CPU, the rank's own measured
rate at a matmul of the run's dtype, so a CPU's MFU says how far a step is from the BLAS's best.
Rank 0 counts and reports; the others pass None and skip the cost.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Callable

__all__ = ["Utilization", "counted", "gpt_flops_per_sample", "gpu_peak", "measured_rate", "precision_column",
           "training_flops"]

# Dense (no sparsity) peaks in TFLOP/s by the run's arithmetic, from NVIDIA's data sheets; the
# first pattern that matches the device's name wins (H100 PCIe before H100, A100 before A10).
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    (r"H100.*PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    (r"H100.*NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    (r"H100|H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"L40S", {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    (r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"\bA10\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"RTX 4090", {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    (r"RTX 3090", {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6}),
    (r"V100", {"fp16": 125.0, "fp32": 15.7}),
    (r"\bT4\b", {"fp16": 65.0, "fp32": 8.1}),
]


def precision_column(precision: str, tf32: bool) -> str:
    """The table's column for train.precision: fp32 runs its matmuls as TF32 where the framework allows it."""
    return "tf32" if precision == "fp32" and tf32 else precision


def gpu_peak(name: str, column: str) -> float | None:
    """Dense peak FLOP/s of the GPU called `name` (as the driver names it) at `column`; None for a
    GPU the table does not know, or arithmetic it has no units for (bf16 on a V100)."""
    for pattern, peaks in PEAK_TFLOPS:
        if re.search(pattern, name):
            return peaks[column] * 1e12 if column in peaks else None
    return None


def measured_rate(matmul: Callable[[], object], flops: float, tries: int = 5) -> float:
    """FLOP/s of `matmul()` (one product of `flops` FLOPs, finished when it returns): its best of
    `tries` timings after one to warm up."""
    matmul()
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        matmul()
        best = min(best, time.perf_counter() - start)
    return flops / max(best, 1e-9)


def gpt_flops_per_sample(parameters: int, layers: int, width: int, context: int) -> float:
    """A GPT's training FLOPs for one window of `context` tokens: 6N + 12·L·d·T a token, N its
    parameters less the position embedding (a lookup, no arithmetic)."""
    return context * (6.0 * parameters + 12.0 * layers * width * context)


def training_flops(model_cfg, language_model: bool, parameters: Callable[[], int],
                   forward: Callable[[], float]) -> float:
    """Model FLOPs of one sample's training step: a GPT's by its `parameters()` (all of them, a
    tied one once; less its position embedding here), any other model's as 3 x `forward()`."""
    if language_model:
        return gpt_flops_per_sample(parameters() - model_cfg.context * model_cfg.width, model_cfg.layers,
                                    model_cfg.width, model_cfg.context)
    return 3.0 * forward()


def counted(model_cfg, language_model: bool, parameters: Callable[[], int], forward: Callable[[], float],
            device_peak: Callable[[], tuple[float, str] | None], devices: int) -> Utilization | None:
    """Rank 0's Utilization of the job, printed in one line: training_flops over `devices`, each of
    `device_peak()`; None where the peak is unknown (a GPU the table lacks)."""
    flops, peak = training_flops(model_cfg, language_model, parameters, forward), device_peak()
    if peak is None or not flops:
        print("mfu: not reported (no known peak for this device)", flush=True)
        return None
    found = Utilization(flops, peak[0] * devices, f"{devices} x {peak[1]}")
    print(found.line(), flush=True)
    return found


@dataclass(frozen=True)
class Utilization:
    flops_per_sample: float   # a training step's model FLOPs for one sample (forward and backward)
    peak: float               # the job's peak FLOP/s: every device it trains on
    devices: str              # what the peak is, for the log: "2 x NVIDIA H100 PCIe, bf16"

    def of(self, samples_per_s: float) -> float:
        """The MFU of a job training `samples_per_s` samples a second."""
        return self.flops_per_sample * samples_per_s / self.peak

    def line(self) -> str:
        return (f"mfu: {_si(self.flops_per_sample)}FLOP a sample (forward and backward), "
                f"the job's peak {_si(self.peak)}FLOP/s ({self.devices})")


def _si(value: float) -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            return f"{value / factor:.3g} {prefix}"
    return f"{value:.3g} "

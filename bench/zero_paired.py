"""Plain data parallelism, ZeRO 1 and ZeRO 2 step by step in one job, so a drift of the machine reaches all alike.

    python bench/zero_paired.py                    # dp 2, the 101 M GPT of memory_bench_zero.py
    python bench/zero_paired.py --np 4 --steps 5

memory_bench_zero.py runs each setting as its own job, and on a shared machine one job's speed
moves by up to a fifth from the next. Here one `horovodrun --gloo` job builds the generated GPT
(hvdgen new --model gpt) once per setting, each with its optimizer (Horovod's DistributedOptimizer
with the CPU ranks' gradient groups, as make_optimizer builds it, or ZeroOptimizer at stage 1 or
2), and trains them in turn, a step each, on the same batch. Rank 0 prints the medians of each
phase (the first step of each left out): forward and backward (ZeRO 2's reduce-scatters run
inside it, plain data parallelism's allreduce starts at its end), synchronize (the rest of the
gradients' reduction), the optimizer's own step, and ZeRO's all-gather of the updated rows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
MODES = ("0", "1", "2")   # horovod.zero


def worker(project: Path, width: int, layers: int, steps: int) -> None:
    sys.path.insert(0, str(project))
    import horovod.torch as hvd
    import torch

    from hvd_runtime.config import ModelConfig
    from hvd_runtime.torch.context import init_horovod
    from hvd_runtime.torch.optim import gradient_groups
    from hvd_runtime.torch.zero import ZeroOptimizer
    from model import build_model

    init_horovod(0)
    context, batch = 128, 2
    torch.manual_seed(0)
    built = {}
    for mode in MODES:
        model = build_model(ModelConfig(width=width, layers=layers, heads=16, context=context), (context,), 256)

        def adamw(params):
            return torch.optim.AdamW(params, lr=1e-4)

        if mode == "0":
            optimizer = hvd.DistributedOptimizer(adamw(model.parameters()), named_parameters=model.named_parameters(),
                                                 groups=gradient_groups(model, torch.device("cpu"), False))
        else:
            optimizer = ZeroOptimizer(model, adamw, int(mode), hvd.global_process_set, hvd.rank(), hvd.size())
        built[mode] = model, optimizer
    x, y = torch.randint(0, 256, (batch, context)), torch.randint(0, 256, (batch, context))
    times = {mode: {"forward+backward": [], "synchronize": [], "optimizer": [], "all-gather": []} for mode in MODES}
    for step in range(steps):
        for mode in MODES:
            model, optimizer = built[mode]
            hvd.allreduce(torch.zeros(1), name=f"start.{step}.{mode}")   # every rank starts the step together
            started = time.perf_counter()
            optimizer.zero_grad()
            out = model(x)
            torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
            backward = time.perf_counter()
            optimizer.synchronize()
            synchronized = time.perf_counter()
            if mode == "0":
                with optimizer.skip_synchronize():
                    optimizer.step()
                stepped = gathered = time.perf_counter()
            else:   # ZeroOptimizer.step after its synchronize, its phases apart
                optimizer.inner.step()
                stepped = time.perf_counter()
                optimizer._gather_updated()
                optimizer._synchronized = False
                gathered = time.perf_counter()
            if step:
                for phase, seconds in zip(times[mode], (backward - started, synchronized - backward,
                                                        stepped - synchronized, gathered - stepped)):
                    times[mode][phase].append(seconds)
    if hvd.rank() == 0:
        plain = sum(statistics.median(v) for v in times["0"].values())
        for mode in MODES:
            phases = {phase: statistics.median(v) for phase, v in times[mode].items()}
            total = sum(phases.values())
            print(f"zero {mode}: {total:.3f} s a step ({plain / total:.2f}x plain) = "
                  + ", ".join(f"{phase} {s:.3f}" for phase, s in phases.items()), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8, help="steps of each setting (the first left out)")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)   # the project, in a rank
    args = ap.parse_args()
    if args.steps < 2 or args.np < 2:
        ap.error(f"--np {args.np} --steps {args.steps}: give 2 ranks or more and 2 steps or more "
                 "(the first is left out)")
    if args.worker:
        worker(args.worker, args.width, args.layers, args.steps)
        return
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([str(BIN / "hvdgen"), "new", "proj", "--model", "gpt", "--output", tmp], check=True,
                       capture_output=True)
        project = Path(tmp) / "proj"
        env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
        subprocess.run([str(BIN / "horovodrun"), "-np", str(args.np), "-H", f"localhost:{args.np}", "--gloo",
                        sys.executable, __file__, "--worker", str(project), "--width", str(args.width), "--layers",
                        str(args.layers), "--steps", str(args.steps)], cwd=project, env=env, check=True)


if __name__ == "__main__":
    main()

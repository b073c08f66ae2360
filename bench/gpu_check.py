"""Every check hvdgen needs a GPU for, in one run on a machine with an NVIDIA GPU.

    python bench/gpu_check.py --out gpu-report                 # build Horovod with NCCL, then every check
    python bench/gpu_check.py --out R --find-links DIR         # offline: the horovod sdist from DIR, no index
    python bench/gpu_check.py --out R --projects DIR           # projects generated elsewhere (DIR/{mlp,resnet18,gpt})
    python bench/gpu_check.py --out R --wheel-cache DIR        # a wheel built elsewhere for this stack: no build
    python bench/gpu_check.py --out R --steps bench --rounds 3 # the build, then only the bench, 3 rounds each

No CI machine has a GPU, so this runs by hand where one is at hand; docs/gpu.md holds what it
reported. Steps, in order of what matters most, each under its own time limit and recorded
whatever its outcome (one failure does not hide the rest), within one overall deadline:

1. build: `hvdgen install-horovod` against the installed CUDA torch (NCCL ops, kernels for this
   GPU only), then `horovodrun --check-build` (NCCL must be listed) and `hvdgen doctor`;
2. collectives: Horovod's allreduce (sum, average, fused group, bf16), allgather and broadcast on
   CUDA tensors under horovodrun, np=1, and np=2 on the one GPU where NCCL allows it;
3. projects: generated data-parallel projects trained on the GPU under horovodrun: the MLP, then
   ResNet-18 on an image folder streamed by loader workers and the GPT on a token file, in bf16,
   fp16 (loss-scaled) and fp32; the train loss must fall; samples/s from metrics.jsonl;
4. bench: bench/workload_worker.py on the GPU in bf16, ResNet-18 (images held in memory) and the
   GPT: the generated loop against Horovod's example loop and torch DDP over NCCL, after a
   warm-up run; with --rounds N, N runs of each loop in alternating order, and the ratios of the medians.

Writes OUT/REPORT.md (a table per step), OUT/results.json and OUT/log.txt (every command's output).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
BIN = Path(PY).parent
MODELS = ("mlp", "resnet18", "gpt")
# The GPU sizes of the generated projects' models (their config.yaml overrides).
PROJECT_SIZES = {
    "mlp": ["--train.epochs", "3"],
    "resnet18": ["--train.epochs", "2", "--train.batch_size", "128", "--data.workers", "6", "--train.log_every", "5"],
    "gpt": ["--train.epochs", "2", "--model.layers", "8", "--model.width", "512", "--model.heads", "8",
            "--model.context", "256", "--train.batch_size", "32", "--data.workers", "2"],
}
# --smoke: the same steps at sizes a CPU runs in seconds, to try this script before a GPU is spent.
SMOKE_SIZES = {
    "mlp": ["--train.epochs", "2"],
    "resnet18": ["--train.epochs", "2", "--model.width", "4", "--data.image_size", "16", "--data.workers", "1"],
    "gpt": ["--train.epochs", "2", "--model.width", "16", "--model.heads", "2", "--model.layers", "1",
            "--model.context", "16"],
}


# The workload bench's loops. A first run of ours (the first workload's) goes before them, kept
# but not compared: on an H100 (2026-11-26) the first benchmark process on a fresh machine ran at
# 15,931 images/s, and the same command at 21,765-21,928 in five runs after it. Those runs also
# measured Horovod's loop woken on enqueue (hvdgen's CPU setting) against its own 1 ms cycle on a
# GPU rank: the same.
BENCH_LOOPS = ("ours", "reference", "ddp")
STEPS = ("collectives", "projects", "bench")


class Checks:
    """Runs commands under a deadline; keeps every result, and every output in one log."""

    def __init__(self, out: Path, deadline_s: float):
        self.out, self.deadline = out, time.monotonic() + deadline_s
        self.results: list[dict] = []
        self.log = (out / "log.txt").open("w")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, step: str, name: str, cmd: list[str], timeout: float, cwd: Path | None = None,
            env: dict | None = None, need: float = 20.0) -> dict:
        """Run cmd (in its own process group, killed whole on timeout) unless under `need` seconds are left."""
        result = {"step": step, "name": name, "cmd": " ".join(cmd)}
        timeout = min(timeout, self.left() - 5)
        if timeout < need:
            result.update(status="skipped", seconds=0.0, output="(no time left before the deadline)")
            return self._keep(result)
        started = time.monotonic()
        try:
            proc = subprocess.Popen(cmd, cwd=cwd, env=child_env(env), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
        except OSError as exc:
            result.update(status="could not start", seconds=0.0, output=str(exc))
            return self._keep(result)
        try:
            output, _ = proc.communicate(timeout=timeout)
            status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            status = f"timeout after {timeout:.0f}s"
        result.update(status=status, seconds=round(time.monotonic() - started, 1), output=output)
        return self._keep(result)

    def _keep(self, result: dict) -> dict:
        self.log.write(f"\n===== {result['step']} / {result['name']}: {result['status']} ({result['seconds']}s)\n"
                       f"$ {result['cmd']}\n{result['output']}\n")
        self.log.flush()
        self.results.append({k: v for k, v in result.items() if k != "output"})
        print(f"[{result['seconds']:6.1f}s] {result['step']} / {result['name']}: {result['status']}", flush=True)
        return result

    def note(self, result: dict, **facts) -> None:
        self.results[-1].update(facts)
        result.update(facts)


def child_env(extra: dict | None) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"
    env.update(extra or {})
    return env


def horovodrun(np_: int, *command: str) -> list[str]:
    return [str(BIN / "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", *command]


def tagged(output: str, tag: str) -> list[dict]:
    return [json.loads(line.split(tag, 1)[1]) for line in output.splitlines() if tag in line]


# ---------------------------------------------------------------------------------------- steps

def build(checks: Checks, args) -> bool:
    import torch

    # --smoke on a machine without a GPU: the H100's and H200's, to try the build step too
    arch = "".join(map(str, torch.cuda.get_device_capability(0))) if torch.cuda.is_available() else "90"
    cache = args.wheel_cache.resolve() if args.wheel_cache else args.work / "cache"
    env = {"HVDGEN_CACHE_DIR": str(cache)}
    if args.find_links:
        # pip reads an sdist's metadata with the build tools at hand: nothing to fetch for an isolated build
        env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(args.find_links.resolve()), PIP_NO_BUILD_ISOLATION="0")
    result = checks.run("build", "hvdgen install-horovod",
                        [PY, "-m", "hvdgen", "install-horovod", "--cuda-arch", arch, "--jobs", str(os.cpu_count())],
                        timeout=420, env=env)
    if result["status"] != "ok":
        for log in cache.glob("horovod-wheels/*.build.log"):
            checks.log.write(f"\n===== {log.name}\n{log.read_text(errors='replace')}\n")
        return False
    built = checks.run("build", "horovodrun --check-build", [str(BIN / "horovodrun"), "--check-build"], timeout=60)
    checks.note(built, nccl="[X] NCCL" in built["output"])
    checks.run("build", "hvdgen doctor", [PY, "-m", "hvdgen", "doctor"], timeout=90)
    return result["status"] == "ok" and built["nccl"]


def collectives(checks: Checks, np_: int) -> None:
    result = checks.run("collectives", f"np={np_}", horovodrun(np_, PY, __file__, "collectives-worker"), timeout=90)
    found = tagged(result["output"], "COLLECTIVES ")
    if found:
        checks.note(result, **found[0])


def write_images(root: Path, classes: int = 4, per_class: int = 1500, size: int = 32) -> None:
    """Each class its own colour under noise: learnable in a few steps, decoded from PNG per batch."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 120, size=(size, size, 3))
            pixels[..., c % 3] += 100 + 30 * (c // 3)
            Image.fromarray(pixels.astype(np.uint8)).save(root / f"class{c}" / f"{i}.png")


def projects(checks: Checks, args, precisions: tuple[str, ...]) -> None:
    data = {"mlp": [], "resnet18": ["--data.source", "image_folder", "--data.path", str(args.work / "images")],
            "gpt": ["--data.path", str(args.work / "tokens")]}
    for precision in precisions:
        for model in MODELS:
            if model == "mlp" and precision != "fp32":
                continue
            project = args.projects / model
            run_dir = args.work / "runs" / f"{model}-{precision}"
            sizes = (SMOKE_SIZES if args.smoke else PROJECT_SIZES)[model]
            cmd = horovodrun(1, PY, "train.py", *sizes, *data[model], "--train.precision", precision,
                             "--tracking.enabled", "false", "--run_dir", str(run_dir),
                             "--checkpoint.dir", str(run_dir / "checkpoints"))
            result = checks.run("projects", f"{model} {precision} np=1", cmd, timeout=150, cwd=project)
            checks.note(result, **epoch_facts(run_dir / "metrics.jsonl"))


def epoch_facts(metrics: Path) -> dict:
    """What metrics.jsonl says: train loss per epoch (must fall), the last epoch's rates."""
    if not metrics.is_file():
        return {}
    epochs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    facts = {"train_loss": [round(e.get("train_loss", float("nan")), 4) for e in epochs]}
    last = epochs[-1] if epochs else {}
    facts.update({f"last_epoch_{k}": round(v, 4) for k, v in last.items()
                  if isinstance(v, float) and k != "train_loss"})
    losses = facts["train_loss"]
    facts["loss_falls"] = len(losses) >= 2 and losses[-1] < losses[0]
    return facts


def bench(checks: Checks, args) -> None:
    import numpy as np

    images = args.work / "images.npz"
    rng = np.random.default_rng(0)
    samples = 512 if args.smoke else 16384
    y = rng.integers(0, 10, size=samples)
    x = rng.normal(size=(samples, 3, 32, 32)).astype(np.float32) + y[:, None, None, None] * 0.1
    np.savez(images, x=x, y=y)
    worker = REPO / "bench" / "workload_worker.py"
    # the GPT first: its loops run longest, and a deadline stops what comes last
    workloads = (("gpt", args.work / "tokens", 32), ("resnet18", images, 256))
    warm_up = "warm-up, not compared"
    runs = [(*workloads[0], "ours", warm_up)]
    for model, data, batch in workloads:
        for r in range(args.rounds):  # the order alternates: no loop always runs first or last
            loops = BENCH_LOOPS if r % 2 == 0 else BENCH_LOOPS[::-1]
            runs += [(model, data, batch, loop, f"round {r + 1}" if args.rounds > 1 else "") for loop in loops]
    rates: dict[str, dict[str, list[float]]] = {model: {} for model, _, _ in workloads}  # compared runs only
    for model, data, batch, loop, why in runs:
        command = [str(worker), "--loop", loop, "--model", model, "--project", str(args.projects / model),
                   "--data", str(data), "--batch-size", str(batch), "--precision", "bf16",
                   *(["--device", "cpu", "--size", "cpu"] if args.smoke else ["--device", "cuda", "--size", "gpu"])]
        cmd = ([str(BIN / "torchrun"), "--standalone", "--nproc-per-node=1", *command] if loop == "ddp"
               else horovodrun(1, PY, *command))
        label = f"{loop} ({why})" if why else loop
        result = checks.run("bench", f"{model} {label} bf16 np=1", cmd, timeout=120)
        found = tagged(result["output"], "BENCH ")
        if found:
            checks.note(result, items_per_s=round(found[0]["items_per_s"], 1))
            if why != warm_up:
                rates[model].setdefault(loop, []).append(result["items_per_s"])
    for model, by_loop in rates.items():
        checks.results.append({"step": "bench", "name": f"{model} ratios (medians)", "status": "computed",
                               "seconds": 0.0, **ratios(by_loop)})


def ratios(by_loop: dict[str, list[float]]) -> dict:
    """One model's rates per loop, and ours over each reference loop: the medians of the rounds."""
    import statistics

    facts = {f"{loop}_per_s": by_loop.get(loop) for loop in BENCH_LOOPS}
    if "ours" in by_loop:
        ours = statistics.median(by_loop["ours"])
        facts.update({f"ours_over_{loop}": round(ours / statistics.median(by_loop[loop]), 3)
                      for loop in BENCH_LOOPS[1:] if loop in by_loop})
    return facts


def report(checks: Checks, out: Path) -> None:
    (out / "results.json").write_text(json.dumps(checks.results, indent=1))
    lines = ["# GPU checks", "", f"`python bench/gpu_check.py` on {gpu_name()}", ""]
    for result in checks.results:
        facts = {k: v for k, v in result.items() if k not in ("step", "name", "cmd", "status", "seconds")}
        lines.append(f"- **{result['step']} / {result['name']}**: {result['status']} in {result['seconds']} s"
                     + (f"; {json.dumps(facts)}" if facts else ""))
    (out / "REPORT.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def gpu_name() -> str:
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU (--smoke)"
    return f"{device}, torch {torch.__version__}, Python {sys.version.split()[0]}"


def check(args) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    args.work = Path(tempfile.mkdtemp(prefix="hvdgen-gpu-"))
    args.projects = args.projects.resolve() if args.projects else None
    checks = Checks(args.out, args.deadline_s)
    try:
        if not args.smoke:
            checks.run("environment", "GPU and tools", ["bash", "-c", "nvidia-smi; nvcc --version; c++ --version; "
                                                        "command -v mpicxx nvcc cmake; nproc; "
                                                        f"{PY} -m pip list 2>/dev/null | grep -iE "
                                                        "'^(setuptools|wheel|packaging|cmake|torch) '"], timeout=30)
        if not (args.skip_build or build(checks, args)):
            return
        if args.projects is None:
            args.projects = args.work / "projects"
            for model in MODELS:
                checks.run("generate", model, [PY, "-m", "hvdgen", "new", model, "--model", model, "--no-input",
                                               "--output", str(args.projects)], timeout=60)
        steps = set(args.steps)
        if "projects" in steps:
            write_images(args.work / "images", per_class=30 if args.smoke else 1500)
        checks.run("data", "prepare_tokens.py", [PY, "prepare_tokens.py", "--out", str(args.work / "tokens"),
                                                 "--max-bytes", str(100_000 if args.smoke else 4_000_000)],
                   timeout=60, cwd=args.projects / "gpt")
        if "collectives" in steps:
            collectives(checks, 1)
        if "projects" in steps:
            projects(checks, args, ("bf16",))
            projects(checks, args, ("fp16",))
        if "bench" in steps:
            bench(checks, args)
        if "projects" in steps:
            projects(checks, args, ("fp32",))
        if "collectives" in steps:
            collectives(checks, 2)  # two ranks on one GPU: NCCL may refuse
    finally:
        report(checks, args.out)


# --------------------------------------------------------------------------- collectives worker

def collectives_worker() -> None:
    """One rank: each collective on CUDA tensors, checked against what it must give; rank 0 reports."""
    import torch

    import horovod.torch as hvd

    hvd.init()
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:  # only to try this script on a machine without a GPU
        device = torch.device("cpu")
    rank, size = hvd.rank(), hvd.size()
    x = torch.full((1000,), float(rank + 1), device=device)
    total = size * (size + 1) / 2
    checked = {}

    summed = hvd.allreduce(x, op=hvd.Sum, name="sum")
    checked["allreduce_sum"] = summed.device == device and bool(torch.all(summed == total))
    averaged = hvd.allreduce(x, op=hvd.Average, name="average")
    checked["allreduce_average"] = bool(torch.allclose(averaged, torch.full_like(x, total / size)))
    group = hvd.grouped_allreduce([x, 2 * x, x.half()], op=hvd.Sum, name="group")
    checked["grouped_allreduce"] = (bool(torch.all(group[0] == total)) and bool(torch.all(group[1] == 2 * total))
                                    and group[2].dtype == torch.float16 and bool(torch.all(group[2] == total)))
    gathered = hvd.allgather(torch.full((2, 3), float(rank), device=device), name="gather")
    expected = torch.arange(size, device=device, dtype=torch.float32).repeat_interleave(2)
    checked["allgather"] = bool(torch.all(gathered[:, 0] == expected))
    broadcast = hvd.broadcast(torch.full((5,), float(rank + 7), device=device), root_rank=0, name="bcast")
    checked["broadcast"] = bool(torch.all(broadcast == 7))

    try:  # a fact, not a check: Horovod 0.28's torch binding knows no bfloat16 (autocast keeps gradients fp32)
        bf16 = bool(torch.all(hvd.allreduce(x.bfloat16(), op=hvd.Sum, name="bf16") == total))
    except (RuntimeError, ValueError) as exc:
        bf16 = str(exc)

    big = torch.ones(64 * 2**20 // 4, device=device)  # 64 MiB: the allreduce's speed
    hvd.allreduce(big, op=hvd.Sum, name="warm")
    started = time.perf_counter()
    for i in range(10):
        hvd.allreduce(big, op=hvd.Sum, name=f"big{i}")
    if device.type == "cuda":
        torch.cuda.synchronize()

    seconds = (time.perf_counter() - started) / 10
    if rank == 0:
        print("COLLECTIVES " + json.dumps({"size": size, "device": str(device), "nccl_built": bool(hvd.nccl_built()),
                                           "all_correct": all(checked.values()), **checked,
                                           "bf16_allreduce": bf16,
                                           "allreduce_64MiB_ms": round(seconds * 1e3, 3)}), flush=True)
    if not all(checked.values()):
        raise SystemExit(f"rank {rank}: wrong results {checked}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", default="check", choices=["check", "collectives-worker"])
    parser.add_argument("--out", type=Path, default=Path("gpu-report"))
    parser.add_argument("--find-links", type=Path, help="a folder holding the horovod sdist (offline build)")
    parser.add_argument("--projects", type=Path, help="generated projects DIR/mlp, DIR/resnet18, DIR/gpt")
    parser.add_argument("--wheel-cache", type=Path,
                        help="hvdgen's cache holding a Horovod wheel built elsewhere for this GPU's stack "
                             "(horovod-wheels/KEY/): installed if its key matches, else built as usual")
    parser.add_argument("--skip-build", action="store_true", help="Horovod with NCCL is already installed")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: try the script, no GPU")
    parser.add_argument("--deadline-s", type=float, default=580.0,
                        help="stop starting steps after this long (every step: about 565 s on an H100)")
    parser.add_argument("--steps", type=lambda text: text.split(","), default=list(STEPS),
                        help=f"a comma-separated subset of {','.join(STEPS)} (the build always runs "
                             "unless --skip-build)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="bench: runs of each loop, in alternating order; ratios are of the medians")
    args = parser.parse_args()
    if unknown := set(args.steps) - set(STEPS):
        parser.error(f"unknown --steps {','.join(sorted(unknown))}: pick from {','.join(STEPS)}")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give 1 or more")
    collectives_worker() if args.mode == "collectives-worker" else check(args)


if __name__ == "__main__":
    main()

"""A GPT of a billion parameters trained on this 2-core machine: ZeRO 3, then pp 2 x tp 2 from its checkpoint.

    python bench/billion.py                       # 20 layers of width 2048: 1.0 B parameters, -np 4
    python bench/billion.py --layers 2 --width 256   # the same path, small

Two generated torch GPT projects (`--zero 3`, data parallel; `--strategy pipeline --stages 2 --tp
2`) on one token folder, untied head, fp32 AdamW, context 64, 4 windows a step, 4 steps an epoch:
1. plain data parallelism at -np 4: the memory plan refuses it up front (16 bytes a parameter on
   every rank), its line recorded;
2. ZeRO 3 at -np 4 trains 3 epochs (12 steps) and writes a sharded checkpoint each epoch;
3. pp 2 x tp 2 at -np 4 resumes the ZeRO 3 checkpoint (each rank reading its stage's slices from
   the ZeRO rows) and trains 3 epochs more.
Each run's epochs (train loss, step time), each rank's peak resident memory (bench/memory_bench_gpt.py's
hook: at parallelize, at each checkpoint, at exit) and the memory plan's line are written to
docs/billion.md at the default size.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_bench_gpt import HOOK  # noqa: E402

BIN = Path(sys.executable).parent
DOCS = Path(__file__).resolve().parent.parent / "docs"
CONTEXT, WINDOWS, STEPS = 64, 4, 4   # per step (global), steps an epoch


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def run(project: Path, np_: int, folder: Path, options: list[str], check: bool = True) -> dict:
    cmd = [str(BIN / "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", sys.executable, "train.py",
           "--tracking.enabled", "false", "--data.workers", "0", "--optim.warmup_epochs", "0", *options,
           "--run_dir", str(folder / "run")]
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", MEMORY_OUT=str(folder),
               MEMORY_FRAMEWORK="torch", PYTHONPATH=os.pathsep.join([str(folder.parent / "hook"),
                                                                    os.environ.get("PYTHONPATH", "")]))
    folder.mkdir(exist_ok=True)
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True)
    took = time.perf_counter() - started
    if check and proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    metrics = folder / "run" / "metrics.jsonl"
    return {"seconds": took, "stdout": proc.stdout, "stderr": proc.stderr, "returncode": proc.returncode,
            "epochs": [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else [],
            "ranks": sorted((json.loads(p.read_text()) for p in folder.glob("rank*.json")), key=lambda r: r["rank"])}


def line_of(out: str, start: str) -> str:
    found = [line.split(":", 1)[1] if line.startswith("[") else line for line in out.splitlines()
             if start in line]
    return found[0].strip() if found else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=20)
    args = ap.parse_args()
    heads = 16
    model = ["--model.width", str(args.width), "--model.layers", str(args.layers), "--model.heads", str(heads),
             "--model.context", str(CONTEXT), "--model.tie_embeddings", "false", "--model.dropout", "0",
             "--optim.lr", "3e-4"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, flags in (("zero", ["--zero", "3"]), ("pptp", ["--strategy", "pipeline", "--stages", "2", "--tp", "2"])):
            subprocess.run([str(BIN / "hvdgen"), "new", name, "--model", "gpt", "--output", str(tmp), *flags],
                           check=True, capture_output=True)
        corpus = tmp / "corpus.txt"
        corpus.write_text(((tmp / "zero" / "README.md").read_text() * 8)[: int((STEPS + 0.6) * WINDOWS * (CONTEXT + 1)
                                                                                / 0.9)])
        subprocess.run([sys.executable, "prepare_tokens.py", str(corpus), "--out", str(tmp / "tokens")],
                       cwd=tmp / "zero", check=True, capture_output=True)
        (tmp / "hook").mkdir()
        (tmp / "hook" / "sitecustomize.py").write_text(HOOK)
        data = ["--data.path", str(tmp / "tokens"), "--checkpoint.dir", str(tmp / "checkpoints")]
        results = {}
        # refused at a billion (at a small --width it fits, and trains an epoch into a folder of its own)
        results["plain"] = run(tmp / "zero", 4, tmp / "plain", [
            *model, "--data.path", str(tmp / "tokens"), "--checkpoint.dir", str(tmp / "plain" / "checkpoints"),
            "--horovod.zero", "0", "--train.batch_size", "1", "--train.epochs", "1"], check=False)
        print("plain data parallel:", line_of(results["plain"]["stdout"] + results["plain"]["stderr"],
                                              "memory: the"), flush=True)
        results["zero3"] = run(tmp / "zero", 4, tmp / "zero3", [*model, *data, "--train.epochs", "3",
                                                                 "--train.batch_size", "1"])
        print(f"ZeRO 3: {results['zero3']['seconds']:.0f} s", flush=True)
        results["pptp"] = run(tmp / "pptp", 4, tmp / "pptp-run", [
            *model, *data, "--train.epochs", "6", "--train.batch_size", str(WINDOWS), "--parallel.micro_batches", "2",
            "--parallel.stages", "2", "--parallel.tp", "2", "--parallel.partition", "params"])
        print(f"pp 2 x tp 2: {results['pptp']['seconds']:.0f} s", flush=True)
    report(results, args, DOCS / "billion.md" if (args.width, args.layers) == (2048, 20) else None)


def report(results: dict, args, out: Path | None) -> None:
    plain = results["plain"]
    lines = ["| run | epoch | step | train loss | s a step | val loss |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, label in (("zero3", "ZeRO 3, -np 4"), ("pptp", "pp 2 x tp 2, -np 4 (resumed)")):
        for e in results[name]["epochs"]:
            lines.append(f"| {label} | {e['epoch']} | {e['step']} | {e['train_loss']:.4f} "
                         f"| {e['train_step_time_ms'] / 1000:.1f} | {e['val_loss']:.4f} |")
    memory = ["| run | rank | baseline | peak while training | peak with the checkpoint | at exit |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, label in (("zero3", "ZeRO 3"), ("pptp", "pp 2 x tp 2")):
        for r in results[name]["ranks"]:
            memory.append(f"| {label} | {r['rank']} | {gib(r['baseline'])} | {gib(max(s[0] for s in r['saves']))} "
                          f"| {gib(max(s[1] for s in r['saves']))} | {gib(r['at_exit'])} |")
    plans = {name: line_of(results[name]["stdout"], "memory: each rank") for name in ("zero3", "pptp")}
    refusal = line_of(plain["stdout"] + plain["stderr"], "memory: the")
    resumed = re.search(r"resuming from \S+: epoch \d+, step \d+", results["pptp"]["stdout"])
    text = "\n".join([
        "# A billion parameters on two cores", "",
        f"`python bench/billion.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: a generated GPT of "
        f"{args.layers} layers of width {args.width} (untied head, fp32, AdamW), context {CONTEXT}, {WINDOWS} windows "
        f"a step, {STEPS} steps an epoch, on this machine's 2 cores and its memory, -np 4 (Gloo).", "",
        f"Plain data parallelism (exit {plain['returncode']}), refused before a value is drawn:", "", f"    {refusal}", "",
        "ZeRO 3's memory plan:", "", f"    {plans['zero3']}", "",
        "pp 2 x tp 2's, resuming ZeRO 3's last checkpoint "
        f"({resumed.group(0) if resumed else 'not resumed'}):", "", f"    {plans['pptp']}", "",
        *lines, "", "Peak resident memory per rank (ru_maxrss), GiB:", "", *memory, "",
        f"Wall time: ZeRO 3 {results['zero3']['seconds']:.0f} s, pp 2 x tp 2 {results['pptp']['seconds']:.0f} s "
        "(start-up, drawing the model, evaluation and checkpoints included).", ""])
    print(text, flush=True)
    if out is not None:
        out.write_text(text)


if __name__ == "__main__":
    main()

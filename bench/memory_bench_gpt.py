"""Does splitting a GPT split its memory? Each rank's peak resident memory, training and checkpointing.

    python bench/memory_bench.py --gpt                      # width 1024, 8 layers: ~101 M parameters
    python bench/memory_bench.py --gpt --width 256 --layers 2   # a quick look

One generated torch project (`--strategy pipeline --stages 2 --tp 2`, GPT, AdamW, fp32) trains a
few steps and writes its epoch's checkpoint at four layouts of the same model: unsplit (-np 1,
one stage, tp 1), tp 2, pp 2 and pp 2 x tp 2 (-np 4). A sitecustomize on every rank reads the
process's peak resident memory (ru_maxrss) where train.py calls parallelize (the baseline: the
interpreter, torch, Horovod, the data, the model on the meta device), where it calls
save_checkpoint (the peak while training, an evaluation included) and when it returns (the peak
with the checkpoint), and at exit (after the whole model is assembled to log it).

Beside each rank: the even share, the training state's 16 bytes a parameter (fp32 weights and
gradients, Adam's two moments) divided by the ranks. The ratios the issue asks for are each
layout's worst rank against the unsplit run, baselines taken off, and each rank's checkpoint peak
against its training peak.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent

HOOK = '''\
"""Each rank's peak resident memory at parallelize, at each save_checkpoint and at exit, to MEMORY_OUT."""
import atexit, json, os, resource
from pathlib import Path

if "HOROVOD_RANK" in os.environ:
    out = Path(os.environ["MEMORY_OUT"]) / f"rank{os.environ['HOROVOD_RANK']}.json"
    record = {"rank": int(os.environ["HOROVOD_RANK"]), "saves": []}

    def peak() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    import hvd_runtime.torch as package
    import hvd_runtime.torch.checkpoint as checkpoint
    import hvd_runtime.torch.parallelize as parallelize_module

    parallelize = parallelize_module.parallelize

    def measured_parallelize(*args, **kwargs):
        record["baseline"] = peak()
        parallel = parallelize(*args, **kwargs)
        record["held_parameters"] = sum(p.numel() for p in parallel.module.parameters())
        return parallel

    save = checkpoint.save_checkpoint

    def measured_save(*args, **kwargs):
        before = peak()
        saved = save(*args, **kwargs)
        record["saves"].append([before, peak()])
        return saved

    parallelize_module.parallelize = measured_parallelize
    checkpoint.save_checkpoint = package.save_checkpoint = measured_save

    @atexit.register
    def write():
        record["at_exit"] = peak()
        out.write_text(json.dumps(record))
'''

# -np, parallel.stages, parallel.tp
LAYOUTS = {"unsplit": (1, 1, 1), "tp 2": (2, 1, 2), "pp 2": (2, 2, 1), "pp 2 x tp 2": (4, 2, 2)}


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def gpt_layouts(width: int, layers: int) -> None:
    heads, context, batch = 16 if width % 16 == 0 else 4, 128, 4
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        subprocess.run([str(BIN / "hvdgen"), "new", "proj", "--model", "gpt", "--framework", "torch", "--strategy",
                        "pipeline", "--stages", "2", "--tp", "2", "--output", str(tmp)], check=True,
                       capture_output=True)
        project = tmp / "proj"
        # about 3 steps of batch x context tokens, and one validation window
        corpus = tmp / "corpus.txt"
        corpus.write_text(((project / "README.md").read_text() * 4)[: int(3.3 * batch * context / 0.9)])
        subprocess.run([sys.executable, "prepare_tokens.py", str(corpus), "--out", str(tmp / "tokens")],
                       cwd=project, check=True, capture_output=True)
        (tmp / "hook").mkdir()
        (tmp / "hook" / "sitecustomize.py").write_text(HOOK)
        results = {}
        for name, (np_, stages, tp) in LAYOUTS.items():
            out = tmp / name.replace(" ", "")
            out.mkdir()
            cmd = [str(BIN / "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", sys.executable,
                   "train.py", "--train.epochs", "1", "--tracking.enabled", "false", "--data.path",
                   str(tmp / "tokens"), "--model.width", str(width), "--model.layers", str(layers), "--model.heads",
                   str(heads), "--model.context", str(context), "--train.batch_size", str(batch),
                   "--parallel.stages", str(stages), "--parallel.tp", str(tp), "--parallel.partition", "params",
                   "--checkpoint.dir", str(out / "checkpoints"), "--run_dir", str(out / "run")]
            env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", MEMORY_OUT=str(out),
                       PYTHONPATH=os.pathsep.join([str(tmp / "hook"), os.environ.get("PYTHONPATH", "")]))
            started = time.perf_counter()
            proc = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            results[name] = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")),
                                   key=lambda r: r["rank"])
            print(f"{name}: {time.perf_counter() - started:.0f} s", flush=True)
    report(results)


def report(results: dict[str, list[dict]]) -> None:
    parameters = sum(r["held_parameters"] for r in results["unsplit"])
    print(f"\nGPT of {parameters / 1e6:.1f} M parameters; training state 16 B/parameter = "
          f"{mib(16 * parameters)} MiB. MiB per rank: baseline, peak training, peak with the checkpoint "
          "(ratio to training), at exit; above the baseline against the even share.")
    unsplit = max(r["saves"][0][0] - r["baseline"] for r in results["unsplit"])
    for name, ranks in results.items():
        print(f"\n{name}:")
        for r in ranks:
            training, with_checkpoint = r["saves"][0]
            share = 16 * parameters / len(ranks)
            print(f"  rank {r['rank']}: baseline {mib(r['baseline'])}, training {mib(training)}, checkpoint "
                  f"{mib(with_checkpoint)} ({with_checkpoint / training:.2f}x), exit {mib(r['at_exit'])}; "
                  f"above baseline {mib(training - r['baseline'])} against an even share of {mib(share)}")
        worst = max(r["saves"][0][0] - r["baseline"] for r in ranks)
        print(f"  worst rank above its baseline: {worst / unsplit:.2f} of the unsplit run's")

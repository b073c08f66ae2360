"""Does splitting a GPT split its memory? Each rank's peak resident memory, training and checkpointing.

    python bench/memory_bench.py --gpt                      # width 1024, 8 layers: ~101 M parameters
    python bench/memory_bench.py --gpt --width 256 --layers 2   # a quick look
    python bench/memory_bench.py --gpt --framework tensorflow

One generated torch (or TensorFlow) project (`--strategy pipeline --stages 2 --tp 2`, GPT, AdamW, fp32) trains a
few steps and writes its epoch's checkpoint at four layouts of the same model: unsplit (-np 1,
one stage, tp 1), tp 2, pp 2 and pp 2 x tp 2 (-np 4). A sitecustomize on every rank reads the
process's peak resident memory (ru_maxrss) where train.py calls parallelize (the baseline: the
interpreter, the framework, Horovod, the data, the model without its parameters' memory), where it calls
save_checkpoint (the peak while training, an evaluation included) and when it returns (the peak
with the checkpoint), and at exit (rank 0 has then written the whole model from the shards).

Beside each rank: the even share, the training state's 16 bytes a parameter (fp32 weights and
gradients, Adam's two moments) divided by the ranks. The ratios the issue asks for are each
layout's worst rank against the unsplit run, baselines taken off, and each rank's checkpoint peak
against its training peak. At the default size it writes docs/benchmarks-memory-gpt.md (TensorFlow:
benchmarks-memory-gpt-tf.md) and its plot beside it.
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

    import sys

    import importlib
    from math import prod

    framework = os.environ["MEMORY_FRAMEWORK"]   # torch | tf: hvd_runtime's package
    package = importlib.import_module(f"hvd_runtime.{framework}")
    # by sys.modules: the package's attribute `parallelize` is the function, not its module
    checkpoint = importlib.import_module(f"hvd_runtime.{framework}.checkpoint")
    parallelize_module = importlib.import_module(f"hvd_runtime.{framework}.parallelize")

    parallelize = parallelize_module.parallelize

    def measured_parallelize(*args, **kwargs):
        record["baseline"] = peak()
        parallel = parallelize(*args, **kwargs)
        module = parallel.module
        held = module.parameters() if framework == "torch" else module.trainable_variables
        record["held_parameters"] = sum(prod(p.shape) for p in held)
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
    def write():  # the rank's own process: others it starts (data loaders, helpers) see HOROVOD_RANK too
        if "baseline" in record:
            record["at_exit"] = peak()
            out.write_text(json.dumps(record))
'''

# -np, parallel.stages, parallel.tp
LAYOUTS = {"unsplit": (1, 1, 1), "tp 2": (2, 1, 2), "pp 2": (2, 2, 1), "pp 2 x tp 2": (4, 2, 2)}


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def gpt_layouts(width: int, layers: int, out: Path | None = None, framework: str = "torch") -> None:
    heads, context, batch = 16 if width % 16 == 0 else 4, 128, 4
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        subprocess.run([str(BIN / "hvdgen"), "new", "proj", "--model", "gpt", "--framework", framework, "--strategy",
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
            folder = tmp / name.replace(" ", "")
            folder.mkdir()
            cmd = [str(BIN / "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", sys.executable,
                   "train.py", "--train.epochs", "1", "--tracking.enabled", "false", "--data.path",
                   str(tmp / "tokens"), "--model.width", str(width), "--model.layers", str(layers), "--model.heads",
                   str(heads), "--model.context", str(context), "--train.batch_size", str(batch),
                   "--parallel.stages", str(stages), "--parallel.tp", str(tp), "--parallel.partition", "params",
                   "--checkpoint.dir", str(folder / "checkpoints"), "--run_dir", str(folder / "run")]
            env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", MEMORY_OUT=str(folder),
                       MEMORY_FRAMEWORK="torch" if framework == "torch" else "tf", TF_CPP_MIN_LOG_LEVEL="2",
                       PYTHONPATH=os.pathsep.join([str(tmp / "hook"), os.environ.get("PYTHONPATH", "")]))
            started = time.perf_counter()
            proc = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            results[name] = sorted((json.loads(p.read_text()) for p in folder.glob("rank*.json")),
                                   key=lambda r: r["rank"])
            print(f"{name}: {time.perf_counter() - started:.0f} s", flush=True)
    report(results, width, layers, out, framework)


def report(results: dict[str, list[dict]], width: int, layers: int, out: Path | None, framework: str) -> None:
    """Print the figures; with `out`, also write them as a page of docs and their plot beside it."""
    parameters = sum(r["held_parameters"] for r in results["unsplit"])
    state = 16 * parameters
    unsplit = max(r["saves"][0][0] - r["baseline"] for r in results["unsplit"])
    lines = [f"GPT of {parameters / 1e6:.1f} M parameters (width {width}, {layers} layers), AdamW, fp32: training "
             f"state 16 B/parameter = {mib(state)} MiB. Per rank, MiB of peak resident memory:", "",
             "| layout | rank | baseline | training | with the checkpoint | checkpoint / training | at exit "
             "| training above baseline | even share |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    worst = {}
    for name, ranks in results.items():
        for r in ranks:
            training, with_checkpoint = r["saves"][0]
            lines.append(f"| {name} | {r['rank']} | {mib(r['baseline'])} | {mib(training)} | {mib(with_checkpoint)} "
                         f"| {with_checkpoint / training:.2f} | {mib(r['at_exit'])} | {mib(training - r['baseline'])} "
                         f"| {mib(state / len(ranks))} |")
        worst[name] = max(r["saves"][0][0] - r["baseline"] for r in ranks) / unsplit
    lines += ["", "Worst rank above its baseline, against the unsplit run's: "
              + ", ".join(f"{name} {ratio:.2f}" for name, ratio in worst.items()) + "."]
    print("\n".join(lines), flush=True)
    if out is None:
        return
    picture = out.with_suffix(".png")
    name = {"torch": "torch", "tensorflow": "TensorFlow"}[framework]
    plot(results, state, picture, name)
    out.write_text("\n".join([TITLE, "", INTRO.format(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                                     framework=name,
                                                     flag="" if framework == "torch" else " --framework tensorflow"), "",
                              *lines, "", f"![peak memory per rank]({picture.name})", ""]))


TITLE = "# Memory benchmark: does splitting a GPT split its memory?"
INTRO = ("`python bench/memory_bench.py --gpt{flag}` on {date}, 2 cores, CPU (Gloo). One generated {framework} project "
         "(`--strategy pipeline --stages 2 --tp 2`, GPT, context 128, batch 4, vocabulary 256 bytes) trains one "
         "short epoch and writes its checkpoint at four layouts of the same model: unsplit (-np 1), tp 2, "
         "pp 2 (cut by parameters) and pp 2 x tp 2 (-np 4); tracking off. Every rank reads its peak resident "
         "memory (ru_maxrss) where train.py calls parallelize (*baseline*: the interpreter, {framework}, "
         "Horovod, the data, the model without its parameters' memory), where it calls save_checkpoint (*training*: the epoch's "
         "steps and its evaluation), when that returns (*with the checkpoint*) and at exit (rank 0 has then "
         "written runs/latest/model.safetensors from the shards). *Even share*: the training state (fp32 "
         "weights and gradients, Adam's two moments: 16 bytes a parameter) divided by the ranks. Above its "
         "baseline a rank also holds activations, the allocator's slack and its stage's or slice's share of "
         "what stays whole (position embeddings, LayerNorms, biases of row-parallel layers).")


def plot(results: dict[str, list[dict]], state: float, path: Path, framework: str) -> None:
    """Each rank's baseline, training peak above it and checkpoint peak above that, beside its even share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, base, training, checkpoint, share = [], [], [], [], []
    for name, ranks in results.items():
        for r in ranks:
            before, after = r["saves"][0]
            labels.append(f"{name}\nrank {r['rank']}")
            base.append(r["baseline"] / 2**20)
            training.append((before - r["baseline"]) / 2**20)
            checkpoint.append(max(after - before, 0) / 2**20)
            share.append(state / len(ranks) / 2**20)
    x = range(len(labels))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    ax.bar(x, base, color="lightgrey", label=f"baseline (interpreter, {framework}, Horovod, data)")
    ax.bar(x, training, bottom=base, color="tab:blue", label="peak while training, above the baseline")
    ax.bar(x, checkpoint, bottom=[b + t for b, t in zip(base, training)], color="tab:orange",
           label="added by the checkpoint")
    ax.scatter(x, [b + s for b, s in zip(base, share)], marker="_", s=600, color="black", zorder=3,
               label="baseline + even share of the training state")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("peak resident memory, MiB")
    ax.set_title(f"A ~100 M-parameter {framework} GPT, AdamW fp32: each rank's peak memory by layout")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)

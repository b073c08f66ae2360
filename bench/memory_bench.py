"""Peak resident memory per rank: is an image folder streamed, and does splitting a GPT split its memory?

    python bench/memory_bench.py                  # 2 GB of 256x256 PNGs, one epoch, -np 2
    python bench/memory_bench.py --gigabytes 0.5 --framework tensorflow
    python bench/memory_bench.py --gpt            # a ~100 M-parameter GPT: unsplit, tp 2, pp 2, pp 2 x tp 2

Writes the folder (random pixels, so PNG cannot compress it), generates a ResNet-18 project,
trains it one epoch under `horovodrun -np 2` (images resized to 32x32 as they are read, by one
DataLoader worker per rank, or tf.data's threads) and samples the resident memory of every rank and worker process
twice a second. Holding the decoded folder in memory would take 4 bytes x 3 x 256 x 256 per
image, 6 times the files' size; streaming keeps each rank far below even the files' size.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

BIN = Path(sys.executable).parent


def write_folder(root: Path, gigabytes: float, side: int = 256) -> int:
    from PIL import Image

    rng = np.random.default_rng(0)
    per_image = side * side * 3 + 1024  # random pixels: PNG stores them nearly raw
    count = int(gigabytes * 1e9 / per_image)
    for i in range(count):
        folder = root / f"class{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, size=(side, side, 3), dtype=np.uint8)).save(folder / f"{i}.png",
                                                                                          compress_level=0)
    return count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gigabytes", type=float, default=2.0)
    parser.add_argument("--framework", choices=("torch", "tensorflow"), default="torch")
    parser.add_argument("--gpt", action="store_true", help="the GPT layouts instead of the image folder")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    if args.gpt:
        from memory_bench_gpt import gpt_layouts

        # the default size writes the docs page; another is only printed
        default = (args.width, args.layers) == (1024, 8)
        page = "benchmarks-memory-gpt.md" if args.framework == "torch" else "benchmarks-memory-gpt-tf.md"
        gpt_layouts(args.width, args.layers, Path(__file__).resolve().parents[1] / "docs" / page if default else None,
                    args.framework)
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        started = time.perf_counter()
        count = write_folder(tmp / "images", args.gigabytes)
        size = sum(f.stat().st_size for f in (tmp / "images").rglob("*.png"))
        print(f"wrote {count} images, {size / 1e9:.2f} GB, in {time.perf_counter() - started:.0f} s", flush=True)
        subprocess.run([str(BIN / "hvdgen"), "new", "proj", "--model", "resnet18", "--framework", args.framework,
                        "--output", str(tmp)], check=True, capture_output=True)
        cmd = [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "train.py",
               "--train.epochs", "1", "--tracking.enabled", "false", "--model.width", "8",
               "--data.source", "image_folder", "--data.path", str(tmp / "images"), "--data.image_size", "32",
               "--train.batch_size", "64", *(["--data.workers", "1"] if args.framework == "torch" else [])]
        env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
        launcher = subprocess.Popen(cmd, cwd=tmp / "proj", env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        peaks: dict[int, tuple[str, int]] = {}
        started = time.perf_counter()
        while launcher.poll() is None:
            for proc in psutil.Process(launcher.pid).children(recursive=True):
                try:
                    if "HOROVOD_RANK" not in proc.environ():
                        continue
                    # a rank's loader processes (its fork server, the workers that server forks, and
                    # multiprocessing's resource tracker) inherit the rank's environment: a rank above them
                    kind = "loader worker" if "HOROVOD_RANK" in proc.parent().environ() else "rank"
                    rss = proc.memory_info().rss
                    if rss > peaks.get(proc.pid, ("", 0))[1]:
                        peaks[proc.pid] = (kind, rss)
                except psutil.Error:
                    pass
            time.sleep(0.5)
        output = launcher.stdout.read().decode()
        if launcher.returncode != 0:
            raise SystemExit(f"training failed:\n{output[-3000:]}")
        seconds = time.perf_counter() - started
    ranks = sorted((rss for kind, rss in peaks.values() if kind == "rank"), reverse=True)
    workers = sorted((rss for kind, rss in peaks.values() if kind == "loader worker"), reverse=True)
    print(f"{args.framework}: one epoch over {size / 1e9:.2f} GB of images in {seconds:.0f} s")
    print("peak resident memory per rank: " + ", ".join(f"{r / 2**20:,.0f} MiB" for r in ranks))
    print(f"peak per loader process ({len(workers)}: per rank a fork server, one worker per split, "
          "a resource tracker): "
          + (", ".join(f"{r / 2**20:,.0f} MiB" for r in workers) or "none seen"))
    print(f"decoded in memory, the folder would take {count * 3 * 256 * 256 * 4 / 2**30:,.1f} GiB")


if __name__ == "__main__":
    main()

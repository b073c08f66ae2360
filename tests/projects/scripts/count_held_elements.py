"""Run a generated torch project's train() and count, on every rank, the parameter elements it made.

Every real (not meta) nn.Parameter made while the project's train() runs is counted as it is
made, and the count taken when parallelize returns: the elements of the parameters this rank
allocated at start-up. parallelize is the project's own, called as train.py calls it; this script
only keeps what it returned, to read the names and shapes of the parameters the rank trains and
its optimizer's state once training is over. Rank 0 writes every rank's record to RANKS_DIR/held.json,
with the unsplit model's names and shapes (built on the meta device: no memory).
usage: horovodrun ... python count_held_elements.py PROJECT RANKS_DIR [config overrides...]
"""

import json
import os
import sys
from pathlib import Path


def main() -> None:
    project, ranks_dir, overrides = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve(), sys.argv[3:]
    workdir = ranks_dir / f"rank{os.environ['HOROVOD_RANK']}"
    workdir.mkdir(parents=True, exist_ok=True)
    os.chdir(workdir)
    sys.path.insert(0, str(project))

    import torch
    from torch import nn

    made = {"elements": 0}
    real_new = nn.Parameter.__new__

    def counted(cls, data=None, requires_grad=True):
        param = real_new(cls, data, requires_grad)
        if not param.is_meta:
            made["elements"] += param.numel()
        return param

    nn.Parameter.__new__ = staticmethod(counted)

    import horovod.torch as hvd

    import train

    kept = {}

    def parallelize(*args, **kwargs):
        kept["parallel"] = train.parallelize.__wrapped__(*args, **kwargs)
        kept["at_start_up"] = made["elements"]
        return kept["parallel"]

    parallelize.__wrapped__ = train.parallelize
    train.parallelize = parallelize
    cfg = train.load_config(train.CONFIG_FILE, overrides)
    train.train(cfg)

    parallel = kept["parallel"]
    held = {name: list(p.shape) for name, p in parallel.module.named_parameters()}
    by_id = {id(p): name for name, p in parallel.module.named_parameters()}
    state = {by_id[id(p)]: [t.numel() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
             for p, s in parallel.optimizer.state.items()}
    record = {"rank": hvd.rank(), "at_start_up": kept["at_start_up"], "held": held, "optimizer_state": state}
    records = hvd.allgather_object(record)
    if hvd.rank() == 0:
        from data import load_data
        from model import build_model

        from hvd_runtime.torch import build_on_meta

        dataset = load_data(cfg, seed=cfg.seed)
        unsplit = build_on_meta(build_model, cfg.model, dataset.input_shape, dataset.num_classes)
        (ranks_dir / "held.json").write_text(json.dumps({
            "ranks": records, "unsplit": {name: list(p.shape) for name, p in unsplit.named_parameters()}}))


if __name__ == "__main__":
    main()

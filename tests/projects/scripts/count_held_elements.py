"""Run a generated torch project's train() and count, on every rank, the parameter elements it made.

Every real (not meta) nn.Parameter made while the project's train() runs is counted as it is
made, and the count taken when parallelize returns: the elements of the parameters this rank
allocated at start-up. parallelize is the project's own, called as train.py calls it; this script
only keeps what it returned, to read the names and shapes of the parameters the rank trains and
its optimizer's state once training is over, and the names and shapes of the whole model it was
handed (on the meta device). Rank 0 writes every rank's record and those to RANKS_DIR/held.json.
usage: horovodrun ... python count_held_elements.py PROJECT RANKS_DIR [config overrides...]
"""

import json

from train_in_rank_dir import enter_rank_dir


def main() -> None:
    _, ranks_dir, overrides = enter_rank_dir()

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

    def parallelize(model, *args, **kwargs):
        # the whole model as train.py built it, on the meta device: read before it is split in place
        kept["unsplit"] = {name: list(p.shape) for name, p in model.named_parameters()}
        kept["parallel"] = train.parallelize.__wrapped__(model, *args, **kwargs)
        kept["at_start_up"] = made["elements"]
        return kept["parallel"]

    parallelize.__wrapped__ = train.parallelize
    train.parallelize = parallelize
    train.train(train.load_config(train.CONFIG_FILE, overrides))

    parallel = kept["parallel"]
    held = {name: list(p.shape) for name, p in parallel.module.named_parameters()}
    by_id = {id(p): name for name, p in parallel.module.named_parameters()}
    state = {by_id[id(p)]: [t.numel() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
             for p, s in parallel.optimizer.state.items()}
    record = {"rank": hvd.rank(), "at_start_up": kept["at_start_up"], "held": held, "optimizer_state": state}
    records = hvd.allgather_object(record)
    if hvd.rank() == 0:
        (ranks_dir / "held.json").write_text(json.dumps({"ranks": records, "unsplit": kept["unsplit"]}))


if __name__ == "__main__":
    main()

"""Run a generated torch project's train() and count, on every rank, the parameter elements it made.

Every real (not meta) nn.Parameter made while the project's train() runs is counted as it is
made, and the count taken when parallelize returns: the elements of the parameters this rank
allocated at start-up. parallelize is the project's own, called as train.py calls it; this script
only keeps what it returned, to read the names and shapes of the parameters the rank trains and
its optimizer's state once training is over, and the names and shapes of the whole model it was
handed (on the meta device).

At each checkpoint (train.py's own save_checkpoint, called as it calls it) every floating-point
tensor an operation makes on new memory is counted, views and in-place results aside, and every
floating-point element a Horovod collective hands back: what a rank allocates or receives to
write its checkpoint. Its shard's tensors are read back from the file, by name
and size. Rank 0 writes every rank's record and those to RANKS_DIR/held.json.
usage: horovodrun ... python count_held_elements.py PROJECT RANKS_DIR [config overrides...]
"""

import json
from pathlib import Path

from collective_counts import counting_collectives
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
    from safetensors import safe_open
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    import train

    class NewMemory(TorchDispatchMode):
        """Counts the elements of the floating-point tensors operations make on new memory."""

        elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            old = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            self.elements += sum(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                                 and t.is_floating_point() and t.untyped_storage().data_ptr() not in old)
            return out

    def received(value) -> int:
        """The floating-point elements in what a collective handed back (tensors, or objects holding them)."""
        return sum(t.numel() for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point())

    kept = {"at_checkpoint": [], "shard": {}}

    def save_checkpoint(checkpoints, parallel, state, ctx, last=False):
        with NewMemory() as counting, counting_collectives(hvd, counting, received):
            written = train.save_checkpoint.__wrapped__(checkpoints, parallel, state, ctx, last=last)
        kept["at_checkpoint"].append(counting.elements)
        # rank 0's folder: every rank wrote its shard there (each rank runs in a folder of its own);
        # named: unnamed, each rank would name it by its own object's type
        folder = hvd.broadcast_object(str(checkpoints.folder_for(state.step).resolve()) if hvd.rank() == 0 else None,
                                      root_rank=0, name="count.checkpoint_folder")
        shard = Path(folder) / f"rank-{hvd.rank():05d}.safetensors"
        if shard.exists():
            with safe_open(shard, framework="pt") as f:
                kept["shard"] = {key: f.get_slice(key).get_shape() for key in f.keys()}
        return written

    save_checkpoint.__wrapped__ = train.save_checkpoint
    train.save_checkpoint = save_checkpoint

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
    record = {"rank": hvd.rank(), "at_start_up": kept["at_start_up"], "held": held, "optimizer_state": state,
              "at_checkpoint": kept["at_checkpoint"], "shard": kept["shard"]}
    records = hvd.allgather_object(record)
    if hvd.rank() == 0:
        (ranks_dir / "held.json").write_text(json.dumps({"ranks": records, "unsplit": kept["unsplit"]}))


if __name__ == "__main__":
    main()

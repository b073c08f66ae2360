"""Run a generated TensorFlow project's train() and count, on every rank, the variable elements it made.

The TensorFlow twin of count_held_elements.py, writing the same record. Every float Keras
variable given a value while the project's train() runs (Keras' own variable creation, and
hvd_runtime.tf.meta_init's draws) is counted as it gets it, and the count taken when parallelize
returns, less the optimizer's own variables: the elements of the model variables this rank
allocated at start-up. parallelize is the project's own, called as train.py calls it; this script
only keeps what it returned, to read the names (hvd_runtime.tf.names) and shapes of the variables
the rank trains and its optimizer's slots once training is over, and the names and shapes of the
whole model it was handed (without values).

At each checkpoint (train.py's own save_checkpoint, called as it calls it) every float variable
given a value is counted, and every floating-point element a Horovod collective hands back: what
a rank allocates or receives to write its checkpoint. Its shard's tensors are read back from the
file, by name and size. Rank 0 writes every rank's record and those to RANKS_DIR/held.json.
usage: horovodrun ... python count_held_variables.py PROJECT RANKS_DIR [config overrides...]
"""

import json
from pathlib import Path
from math import prod

from collective_counts import counting_collectives
from train_in_rank_dir import enter_rank_dir


def main() -> None:
    _, ranks_dir, overrides = enter_rank_dir()

    import numpy as np
    from keras.src.backend.tensorflow.core import Variable

    given: list = []   # float variables given a value, in order
    real_initialize = Variable._initialize

    def counted(self, value):
        real_initialize(self, value)
        if "float" in str(self.dtype):
            given.append(self)

    Variable._initialize = counted

    import horovod.tensorflow as hvd
    import tensorflow as tf
    from safetensors import safe_open

    import train
    from hvd_runtime.tf.checkpoint import held_variables
    from hvd_runtime.tf.names import whole_names

    def received(value) -> int:
        """The floating-point elements in what a collective handed back (tensors, arrays, or objects holding them)."""
        leaves = tf.nest.flatten(value, expand_composites=True)
        return sum(int(np.size(t)) for t in leaves if isinstance(t, (tf.Tensor, np.ndarray))
                   and np.issubdtype(np.dtype(t.dtype.as_numpy_dtype if isinstance(t, tf.Tensor) else t.dtype),
                                     np.floating))

    class Counting:
        elements = 0

    kept = {"at_checkpoint": [], "shard": {}}

    def save_checkpoint(checkpoints, parallel, state, ctx, last=False):
        before = len(given)
        with counting_collectives(hvd, Counting(), received) as counting:
            written = train.save_checkpoint.__wrapped__(checkpoints, parallel, state, ctx, last=last)
        kept["at_checkpoint"].append(counting.elements + sum(prod(v.shape) for v in given[before:]))
        # rank 0's folder: every rank wrote its shard there (each rank runs in a folder of its own);
        # named: unnamed, each rank would name it by its own object's type
        folder = hvd.broadcast_object(str(checkpoints.folder_for(state.step).resolve()) if hvd.rank() == 0 else None,
                                      root_rank=0, name="count.checkpoint_folder")
        shard = Path(folder) / f"rank-{hvd.rank():05d}.safetensors"
        if shard.exists():
            with safe_open(shard, framework="np") as f:
                kept["shard"] = {key: f.get_slice(key).get_shape() for key in f.keys()}
        return written

    save_checkpoint.__wrapped__ = train.save_checkpoint
    train.save_checkpoint = save_checkpoint

    def parallelize(model, *args, **kwargs):
        names = whole_names(model)   # the whole model as train.py built it, without values
        kept["unsplit"] = {names[id(v)]: list(v.shape) for v in model.variables if id(v) in names}
        parallel = kept["parallel"] = train.parallelize.__wrapped__(model, *args, **kwargs)
        if not parallel.optimizer.built:   # Keras builds it at the first step: built now, it is not counted
            parallel.optimizer.build(parallel.module.trainable_variables)
        optimizer = {id(v) for v in parallel.optimizer.variables}
        kept["at_start_up"] = sum(prod(v.shape) for v in given if id(v) not in optimizer)
        return parallel

    parallelize.__wrapped__ = train.parallelize
    train.parallelize = parallelize
    train.train(train.load_config(train.CONFIG_FILE, overrides))

    parallel = kept["parallel"]
    entries = held_variables(parallel.module, parallel.optimizer, parallel.slices)
    trained = {id(v) for v in parallel.module.trainable_variables}
    held = {name[len("model/"):]: list(v.shape) for v, name, _ in entries if name.startswith("model/") and id(v) in trained}
    state: dict[str, list[int]] = {}
    for v, name, _ in entries:
        owner = name[len("optimizer/"):].rsplit("/", 1)[0]
        if name.startswith("optimizer/") and owner in held and len(v.shape) > 0:
            state.setdefault(owner, []).append(prod(v.shape))
    record = {"rank": hvd.rank(), "at_start_up": kept["at_start_up"], "held": held, "optimizer_state": state,
              "at_checkpoint": kept["at_checkpoint"], "shard": kept["shard"]}
    records = hvd.allgather_object(record)
    if hvd.rank() == 0:
        (ranks_dir / "held.json").write_text(json.dumps({"ranks": records, "unsplit": kept["unsplit"]}))


if __name__ == "__main__":
    main()

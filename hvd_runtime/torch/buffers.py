"""One set of BatchNorm running statistics for the whole job, whenever it is saved or evaluated.

With BatchNorm per worker (the default; not SyncBatchNorm), each rank's running mean and
variance follow its own batches, so ranks hold slightly different models. A checkpoint holds rank
0's buffers and a resumed job broadcasts them to every rank: unless the ranks agreed at the moment
of saving, the resumed run would continue from other statistics than the uninterrupted one did.
Averaging the floating-point buffers over the ranks at each checkpoint and before each evaluation
(as large-scale ImageNet training does before evaluating) makes the saved model the job's model
and resume exact. Integer buffers (batches seen) are equal on every rank already.
"""

from __future__ import annotations

from torch import nn


def average_buffers(model: nn.Module, process_set=None, name: str = "buffers") -> None:
    """Every rank calls; afterwards every rank (of `process_set`) holds the mean of each float buffer."""
    import horovod.torch as hvd

    buffers = [b for b in model.buffers() if b.is_floating_point()]
    if not buffers or (process_set is None and hvd.size() == 1):
        return
    kwargs = {} if process_set is None else {"process_set": process_set}
    # Horovod: every running statistic averaged in place, all in flight at once (fused by Horovod's
    # background loop); one by one, since a split model's buffers may sit on several GPUs
    handles = [hvd.allreduce_async_(b, op=hvd.Average, name=f"{name}.{i}", **kwargs) for i, b in enumerate(buffers)]
    for handle in handles:
        hvd.synchronize(handle)

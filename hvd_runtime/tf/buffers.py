"""One set of BatchNorm moving statistics for the whole job, whenever it is saved or evaluated.

With BatchNorm per worker (the default; not SyncBatchNorm), each rank's moving mean and variance
follow its own batches, so ranks hold slightly different models. A checkpoint holds rank 0's
variables and a resumed job broadcasts them to every rank: unless the ranks agreed at the moment
of saving, the resumed run would continue from other statistics than the uninterrupted one did.
Averaging the non-trainable float variables over the ranks at each checkpoint and before each
evaluation makes the saved model the job's model and resume exact, as hvd_runtime.torch.buffers
does for PyTorch. Integer variables (dropout seed states) are each rank's own and stay so.
"""

from __future__ import annotations


def average_statistics(model, process_set=None, name: str = "statistics") -> None:
    """Every rank calls; afterwards every rank (of `process_set`) holds the mean of each statistic."""
    import horovod.tensorflow as hvd

    statistics = [v for v in model.variables if not v.trainable and "float" in str(v.dtype)]
    if not statistics or (process_set is None and hvd.size() == 1):
        return
    kwargs = {} if process_set is None else {"process_set": process_set}
    # Horovod: every moving statistic averaged in one grouped allreduce
    means = hvd.grouped_allreduce([v.value for v in statistics], op=hvd.Average, name=name, **kwargs)
    for v, mean in zip(statistics, means):
        v.assign(mean)

"""hvd_runtime: what a generated train.py imports inside every horovodrun rank.

Framework-free pieces sit at the top (config, data, checkpoint, schedule, partition, timeline);
`hvd_runtime.torch` and `hvd_runtime.tf` hold what is bound to one framework.
"""

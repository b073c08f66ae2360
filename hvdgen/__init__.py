"""hvdgen: generate Horovod training projects that work the first time."""

__version__ = "0.1.0"

"""The strategies a generated train.py names in its one `parallelize()` call, for both frameworks.

hvd_runtime.{torch,tf}.parallelize take the name as train.py writes it; the generator's catalog
(hvdgen.catalog) says which ones exist for a framework and model. A rank imports no generator.
"""

STRATEGIES = ("data", "model-split", "tensor", "pipeline")


def check_strategy(strategy: str) -> None:
    """One line for a name parallelize() does not know (a hand-edited train.py)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")

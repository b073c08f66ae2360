"""The one check every parallel layout makes: its factor is a positive integer that divides the world."""

from __future__ import annotations


def check_factor(world: int, factor, name: str, option: str, error: type[Exception]) -> None:
    """Raise `error` with one line naming -np and the factor unless `factor` divides `world`.

    name: how the layout calls the factor ("stages", "tp"); option: how the user sets it.
    """
    if not isinstance(factor, int) or factor < 1:
        raise error(f"{name} must be a positive integer, got {factor!r} (e.g. 2)")
    if world % factor:
        raise error(f"world size {world} (horovodrun -np) is not {name} {factor} x replicas: "
                    f"use -np {factor}, {2 * factor}, {3 * factor}... or a {option} that divides {world}")

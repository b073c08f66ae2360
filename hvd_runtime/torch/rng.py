"""Each rank's random generators' states as JSON values: what a checkpoint stores (no pickle in it).

    states = rng_state()          # Python, NumPy, torch and CUDA generators of this rank
    set_rng_state(states)         # on resume, handed back to the same rank
"""

from __future__ import annotations

import base64

import torch

from hvd_runtime.checkpoint import host_rng_state, set_host_rng_state

__all__ = ["rng_state", "set_rng_state", "tensor_text"]


def tensor_text(t: torch.Tensor) -> str:
    """A uint8 tensor (a generator's state) as base64 text."""
    return base64.b64encode(t.numpy().tobytes()).decode()


def _tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state() -> dict:
    """This rank's Python, NumPy, torch and CUDA generator states, as JSON-ready values."""
    return {**host_rng_state(), "torch": tensor_text(torch.get_rng_state()),
            "cuda": [tensor_text(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else []}


def set_rng_state(state: dict) -> None:
    set_host_rng_state(state)
    torch.set_rng_state(_tensor(state["torch"]))
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_tensor(s) for s in state["cuda"]])

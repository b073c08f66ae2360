"""One problem found in a manifest: where it is and how to fix it, printed as one line."""

from __future__ import annotations

from dataclasses import dataclass


def field_path(parts) -> str:
    """`spec.mpiReplicaSpecs.Worker.template.spec.containers[0].resources` from path parts."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(document)"


@dataclass(frozen=True)
class Problem:
    path: str  # dotted field path inside the object; "" for the file as a whole
    message: str  # what is wrong and the fix, e.g. "unknown field 'limit': did you mean 'limits'?"
    source: str = ""  # file or overlay the object came from

    def where(self, source: str) -> "Problem":
        return Problem(self.path, self.message, source)

    def __str__(self) -> str:
        """Always one line, whatever a parser put into the message."""
        parts = [part for part in (self.source, self.path) if part]
        return " ".join(": ".join(parts + [self.message]).split())

"""Cross-entropy and accuracy of logits split over the vocabulary, for PyTorch (Megatron-LM's vocab-parallel loss).

    objective = VocabObjective.of(group, vocab)     # plain cross-entropy and accuracy for no group or tp 1
    loss = objective.cross_entropy(logits, target)  # logits: this rank's vocabulary rows only
    correct = objective.accuracy_sum(logits, target)

A head split by `apply_tp` answers each rank's slice of the vocabulary's logits (token ids
`vocab_range(vocab, tp, rank)`). Gathering them would rebuild the largest tensor of a language
model on every rank; instead the softmax's pieces are summed over the group:

    loss = log(sum over the whole vocabulary of exp(logit - max)) - (target's logit - max)

Each rank sums exp over its rows and picks the target's logit if it holds it (0 otherwise); one
allreduce adds both over the group, after one that finds the max (for a stable exp; it cancels in
the gradient, so it is taken without one). The sum is Megatron's g (identity backward), so
autograd gives each rank softmax - one-hot on its own rows: the unsplit loss's gradient, sliced.
Accuracy asks which rank holds the first largest logit, as argmax does, in two allreduces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hvd_runtime.parallel.tensor_groups import TensorGroup, VocabularyShare
from hvd_runtime.torch import objective
from hvd_runtime.torch.tensor_parallel import sum_over_group

__all__ = ["VocabObjective"]


def _reduce(tensor: torch.Tensor, op_name: str, group: TensorGroup, name: str) -> torch.Tensor:
    import horovod.torch as hvd

    return hvd.allreduce(tensor.contiguous(), op=getattr(hvd, op_name), process_set=group.process_set, name=name)


@dataclass(frozen=True)
class VocabObjective(VocabularyShare):
    """The training loss and accuracy of one rank's logits: whole, or its rows of a split vocabulary."""

    def cross_entropy(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over every position, as hvd_runtime.torch.objective.cross_entropy (fp32)."""
        if self.group is None:
            return objective.cross_entropy(logits, target)
        rows = self.rows
        logits, target = logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1)
        with torch.no_grad():
            top = _reduce(logits.max(dim=-1).values, "Max", self.group, "tp.ce.max")
        shifted = logits - top.unsqueeze(-1)
        mine = (target >= rows.start) & (target < rows.stop)
        picked = shifted.gather(1, (target - rows.start).clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        sums = sum_over_group(torch.stack([shifted.exp().sum(dim=-1), picked * mine]), self.group, "tp.ce.sums")
        return (sums[0].log() - sums[1]).mean()

    @torch.no_grad()
    def accuracy_sum(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The sum over samples of each sample's share of positions predicted right (argmax over the vocabulary)."""
        if self.group is None:
            return objective.accuracy_sum(logits, target)
        local_top, local_first = logits.float().max(dim=-1).values, logits.argmax(dim=-1)
        top = _reduce(local_top, "Max", self.group, "tp.accuracy.max")
        # The first id holding the largest logit: this rank's first, where its largest is the largest.
        mine = torch.where(local_top == top, local_first + self.rows.start, torch.full_like(local_first, self.vocab))
        first = _reduce(mine, "Min", self.group, "tp.accuracy.first")
        hits = (first == target.to(first.device)).float()
        return hits.reshape(len(target), -1).mean(dim=1).sum()

    def accuracy(self, logits: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        """A pipeline engine's metrics_fn: the batch's mean accuracy, left where it was computed."""
        return {"accuracy": self.accuracy_sum(logits, target) / len(target)}

"""One rank of the tensor-parallel benchmark: the generated GPT, split over tp ranks, trained on random tokens.

    horovodrun -np 2 -H localhost:2 --gloo python bench/tp_worker.py --project DIR --tp 2
    horovodrun -np 1 -H localhost:1 --gloo python bench/tp_worker.py --project DIR --tp 1 --threads 2

Builds the project's model.py (unchanged) at the size given, splits it with apply_tp over a group
of `tp` ranks (tp 1: unsplit), and times training steps (forward, backward, the group's
allreduces, AdamW, whole-model clipping) after warm-up steps, between barriers. Rank 0 prints
one `BENCH {...}` JSON line: the median step time, this rank's parameter bytes in the split
layers (qkv, proj, the MLP's two linears, and the token embedding the head is tied to) and in the
whole model, and the rise of the resident memory over the steps (activations, gradients,
optimizer state) above what the model took. The loss is the vocabulary-parallel one
(hvd_runtime.torch.vocab_parallel): the logits stay split.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.tp_worker_common import (VOCAB, model_config, parse_args, peak_rss_bytes, print_report,  # noqa: E402
                                    timed_steps)
from hvd_runtime.torch.context import init_horovod  # noqa: E402
from hvd_runtime.torch.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,  # noqa: E402
                                               VocabParallelEmbedding, apply_tp)
from hvd_runtime.torch.tensor_state import SlicedParameters  # noqa: E402
from hvd_runtime.torch.vocab_parallel import VocabObjective  # noqa: E402

SPLIT_NAMES = ("qkv", "proj", "mlp.0", "mlp.2", "tokens", "out")
SPLIT_TYPES = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, torch.nn.Linear, torch.nn.Embedding)


def split_layer_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters of the layers tensor parallelism splits, split or not."""
    held = {id(p): p for name, module in model.named_modules()
            if isinstance(module, SPLIT_TYPES) and name.endswith(SPLIT_NAMES) for p in module.parameters()}
    return sum(p.numel() * p.element_size() for p in held.values())  # a tied head's weight counted once


def main() -> None:
    args = parse_args()
    import horovod.torch as hvd

    sys.path.insert(0, str(args.project))
    from model import build_model

    ctx = init_horovod(seed=0, threads_per_rank=args.threads, tp=args.tp)
    torch.manual_seed(0)  # one model on every rank and at every tp: the losses of tp 1 and tp 2 must agree
    model = apply_tp(build_model(model_config(args), (args.context,), VOCAB), ctx.tensor.group)
    split = SlicedParameters(model)
    objective = VocabObjective.of(ctx.tensor.group, VOCAB)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model_rss = peak_rss_bytes()
    generator = torch.Generator().manual_seed(1)  # every rank of the group reads the same batch
    x = torch.randint(0, VOCAB, (args.batch, args.context), generator=generator)
    y = torch.randint(0, VOCAB, (args.batch, args.context), generator=generator)

    def train_step() -> float:
        loss = objective.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), 1.0, split.grad_norm())
        optimizer.step()
        return float(loss)

    times, loss = timed_steps(args, train_step, hvd.barrier)
    print_report(hvd, args, times, loss, split_layer_bytes(model),
                 sum(p.numel() * p.element_size() for p in model.parameters()), peak_rss_bytes() - model_rss)


if __name__ == "__main__":
    main()

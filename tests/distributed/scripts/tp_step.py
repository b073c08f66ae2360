"""One training step of a model split by tensor parallelism, against the whole model in the same process.

    horovodrun -np 2 --gloo python tp_step.py --tp 2 --out r.json                      # the MLP, tp=2
    horovodrun -np 4 --gloo python tp_step.py --tp 2 --out r.json                      # tp=2 x dp=2
    horovodrun -np 2 --gloo python tp_step.py --tp 2 --model gpt --project DIR --out r.json
    horovodrun -np 4 --gloo python tp_step.py --tp 2 --model gpt --project DIR --vocab 17 --tied --out r.json

Every rank builds the same model and runs the whole global batch through it as the reference.
The MLP (Linear, GELU, Linear, GELU, Linear) has its first two linears split as a column-parallel /
row-parallel pair and its last one whole; the GPT of a generated project (`hvdgen new --model
gpt`) is split by `apply_tp`: blocks, token embedding and head, its logits split over the
vocabulary and trained with hvd_runtime.torch.vocab_parallel's loss (an odd vocabulary splits
unevenly; a tied head stays tied). The rank feeds the split copy its data-parallel replica's share
of the batch, and Horovod averages gradients over the replicas. Each rank reports the relative
error of its outputs (its vocabulary rows of the logits), of the loss and accuracy (gpt), of its
input's gradient (MLP) and of every parameter's gradient against the matching slice of the
reference; rank 0 writes all ranks' reports as JSON.
"""

import argparse
import copy

import horovod.torch as hvd
import torch
from torch import nn

from hvd_runtime.parallel.tensor_groups import init_tensor_parallel
from hvd_runtime.torch.objective import accuracy_sum
from hvd_runtime.torch.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, TensorGroup,
                                               VocabParallelEmbedding, apply_tp)
from hvd_runtime.torch.vocab_parallel import VocabObjective

from step_driver import write_results
from workloads import load_workload

FEATURES, HIDDEN, OUT, BATCH = 12, 16, 5, 8


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def mlp() -> nn.Sequential:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
                         nn.Linear(HIDDEN, OUT))


def split_mlp(model: nn.Sequential, group: TensorGroup) -> nn.Sequential:
    return nn.Sequential(ColumnParallelLinear(model[0], group), nn.GELU(), RowParallelLinear(model[2], group),
                         nn.GELU(), copy.deepcopy(model[4]))


def gradient_errors(split: nn.Module, model: nn.Module) -> dict[str, float]:
    """Each of the split model's parameter gradients against the reference's, or the slice this rank holds."""
    reference = dict(model.named_parameters(remove_duplicate=False))  # a tied head's weight under both names
    errors = {}
    for module_name, module in split.named_modules():
        for name, p in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            want = reference[full].grad
            if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
                want = want[module.source_index]
            elif isinstance(module, RowParallelLinear) and name == "weight":
                want = want[:, module.source_index]
            errors[full] = rel(p.grad, want)
    return errors


def split_share(split: nn.Module, model: nn.Module) -> float:
    """Elements of the split layers' weights this rank holds, over the same layers' whole weights."""
    whole = dict(model.named_modules())
    held = [(m.weight.numel(), whole[name].weight.numel()) for name, m in split.named_modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding))]
    return sum(h for h, _ in held) / sum(w for _, w in held)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--model", default="mlp", choices=["mlp", "gpt"])
    ap.add_argument("--project", help="a generated --model gpt project, for its model.py")
    ap.add_argument("--vocab", type=int, default=16, help="gpt: the vocabulary size")
    ap.add_argument("--tied", action="store_true", help="gpt: the head tied to the token embedding")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    ranks = init_tensor_parallel(hvd, args.tp)
    layout, group, dp_set, rank = ranks.dims, ranks.group, ranks.dp_set, hvd.rank()

    if args.model == "gpt":
        workload = load_workload("gpt", args.project, vocab=args.vocab, tied=args.tied)
        model = workload.build()
        x, target = workload.batch(torch.Generator().manual_seed(11), BATCH)
        objective = VocabObjective.of(group, args.vocab)

        def loss_of(out, y):
            return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    else:
        model = mlp()
        g = torch.Generator().manual_seed(11)
        x, target = torch.randn(BATCH, FEATURES, generator=g), torch.randn(BATCH, OUT, generator=g)
        loss_of = nn.functional.mse_loss

    # The reference: the whole batch through the whole model, the loss a mean over the batch.
    ref_x = x.clone().requires_grad_(x.is_floating_point())
    ref_out = model(ref_x)
    loss_of(ref_out, target).backward()

    # The split copy, on this replica's share of the batch.
    split = apply_tp(copy.deepcopy(model), group) if args.model == "gpt" else split_mlp(model, group)
    share = slice(rank // layout.tp * BATCH // layout.dp, (rank // layout.tp + 1) * BATCH // layout.dp)
    my_x = x[share].clone().requires_grad_(x.is_floating_point())
    out = split(my_x)
    if args.model == "gpt":  # the logits are this rank's vocabulary rows: the reference's slice of them
        rows = split[-1].out.source_index
        loss = objective.cross_entropy(out, target[share])
        ref_loss = loss_of(ref_out[share], target[share]).detach()
        ref_out = ref_out[..., rows]
        correct = objective.accuracy_sum(out.detach(), target[share])
        ref_correct = accuracy_sum(model(x[share]).detach(), target[share])
    else:
        loss = loss_of(out, target[share])
    loss.backward()
    for p in split.parameters():  # the replicas' mean: the gradient of the global batch's mean
        if dp_set is not None:
            p.grad = hvd.allreduce(p.grad, op=hvd.Average, process_set=dp_set)

    errors = {"output": rel(out.detach(), ref_out.detach()[share]), **gradient_errors(split, model)}
    if args.model == "gpt":
        errors["loss"] = rel(loss.detach(), ref_loss)
        errors["accuracy"] = rel(correct, ref_correct) if ref_correct else float(correct != 0)
    if x.is_floating_point():  # each replica's loss is a mean over its share: dp times a sample's weight
        errors["input_grad"] = rel(my_x.grad / layout.dp, ref_x.grad[share])
    compared = {name for name in errors if name not in ("output", "input_grad")}
    report = {"rank": rank, "tp_rank": group.rank, "errors": errors, "split_share": split_share(split, model),
              "uncompared": sorted(set(dict(model.named_parameters())) - compared)}
    write_results(hvd, report, args.out)


if __name__ == "__main__":
    main()

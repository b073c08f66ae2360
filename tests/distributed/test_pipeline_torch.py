"""PyTorch pipeline and model-split: the same numbers as the whole model in one process.

Fast tests check the grid arithmetic, stage cutting and model-split in-process; the slow ones run
real `horovodrun --gloo` jobs whose every rank compares itself with a single-process reference.
"""

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torch import nn

from helpers import bench_links, horovodrun_path, run_horovod, venv_env
from helpers.pipeline_checks import TOL, check_against_reference
from helpers.pipeline_jobs import grid_jobs, model_split_job
from hvd_runtime.pipeline.partition import PartitionError, partition
from hvd_runtime.pipeline.timeline import load_timeline, replayed_bubble, step_bubble, step_replayed_bubble
from hvd_runtime.torch.grid import PipelineConfigError
from hvd_runtime.torch.model_split import ModelSplit
from p2p_links import header, read_header
from hvd_runtime.torch.pipeline import micro_batch_sizes
from hvd_runtime.torch.stage import build_stage, plan_stages
from hvdgen.cli import main as cli

SCRIPTS = Path(__file__).parent / "scripts"  # on pytest's pythonpath (pyproject.toml)
from pipeline_step import CLASSES, FEATURES, make_model, rel  # noqa: E402

ALL_BLOCKS = [str(i) for i in range(7)]


# -- grid, micro-batches, stages: no Horovod needed -----------------------------------------------

@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_the_grid_knows_the_world_size_before_horovod_starts(controller):
    """The grid's process sets go to hvd.init, so its size comes from what the launcher set, and
    horovodrun with Gloo and with MPI (through mpirun) set different variables."""
    from horovod.common.util import mpi_built

    if controller == "mpi" and not (mpi_built() and shutil.which("mpirun")):
        pytest.skip("Requires: OpenMPI and a Horovod built with it (scripts/setup.sh)")
    code = ("import sys; from hvd_runtime.parallel.world import launched_world_size as n; "
            "sys.stdout.write(f'world {n()}\\n')")
    proc = subprocess.run([horovodrun_path(), "-np", "2", "-H", "localhost:2", f"--{controller}",
                           sys.executable, "-c", code], env=venv_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert sorted(re.findall(r"world (\w+)", proc.stdout)) == ["2", "2"], proc.stdout[-2000:]
    alone = subprocess.run([sys.executable, "-c", code], env=venv_env(), capture_output=True, text=True)
    assert alone.stdout.split() == ["world", "None"], alone.stderr[-2000:]


def test_micro_batch_sizes_follow_tensor_split():
    assert micro_batch_sizes(10, 4) == [len(c) for c in torch.arange(10).tensor_split(4)] == [3, 3, 2, 2]
    with pytest.raises(PipelineConfigError, match="micro_batches 5 exceeds the batch size 4"):
        micro_batch_sizes(4, 5)


@pytest.mark.parametrize("t", [torch.randn(3, 4, 5), torch.arange(7), torch.ones(2, 3, dtype=torch.bfloat16),
                               torch.zeros(0, 4), torch.tensor(2.5)])
def test_p2p_header_describes_dtype_and_shape(t):
    dtype, shape = read_header(header(t))
    assert dtype == t.dtype and shape == tuple(t.shape)


def test_p2p_header_refuses_too_many_dims():
    with pytest.raises(ValueError, match="cannot send a tensor of 9 dims between stages: at most 8"):
        header(torch.zeros([1] * 9))


def test_stages_keep_the_model_names_and_cover_it():
    model = make_model()
    plan = plan_stages(model, 2)
    stages = [build_stage(model, k, plan) for k in range(2)]
    keys = [k for s in stages for k in s.state_dict()]
    assert keys == list(model.state_dict())
    assert all(s.state_dict()[k] is not None for s in stages for k in s.state_dict())
    x = torch.randn(4, FEATURES)
    assert torch.equal(stages[1](stages[0](x)), model(x))
    by_name = build_stage(model, 1, plan_stages(model, 2, ["4"]))
    assert list(by_name.state_dict()) == ["4.weight", "4.bias", "6.weight", "6.bias"]
    timed = plan_stages(model, 2, "time", sample=x)
    assert timed.stages == 2 and all(c > 0 for c in timed.costs[::2])
    with pytest.raises(PartitionError, match="partition by='time' needs sample="):
        plan_stages(model, 2, "time")


def test_time_partition_counts_the_last_stages_loss_with_its_last_block():
    """The loss and metrics run on the last stage only: a costly one moves the cut towards the end."""
    model, x = make_model(), torch.randn(4, FEATURES)
    seen = []
    plain = plan_stages(model, 2, "time", sample=x)
    # a loss dearer than all the blocks together, by a margin that a loaded machine's slower blocks
    # (several workers on two cores) do not eat: the last block must then stand alone
    pause = 0.05 + 10 * sum(plain.costs)

    def tail(out):
        seen.append(out)
        time.sleep(pause)
        return out.square().mean()

    with_tail = plan_stages(model, 2, "time", sample=x, tail=tail)
    blocks = len(plain.names)
    assert len(seen) == 3 and all(out.requires_grad for out in seen)
    torch.testing.assert_close(seen[0], model(x), rtol=0, atol=0)
    assert with_tail.costs[-1] >= pause > max(with_tail.costs[:-1] + plain.costs)
    # the cut is the one the costs with the loss give; where the other blocks together stay under
    # the loss (all but a machine so loaded that their timings swell), the last block stands alone
    assert with_tail.bounds == partition(with_tail.names, with_tail.costs, 2).bounds
    if sum(with_tail.costs[:-1]) < pause:
        assert with_tail.bounds[-1] == (blocks - 1, blocks)
    normed = nn.Sequential(nn.Linear(FEATURES, 8), nn.BatchNorm1d(8), nn.Linear(8, CLASSES))
    before = {k: v.clone() for k, v in normed.state_dict().items()}
    plan_stages(normed, 2, "time", sample=x, tail=lambda out: out.square().mean())
    assert all(torch.equal(v, before[k]) for k, v in normed.state_dict().items()), "timing moved BatchNorm's statistics"
    with pytest.raises(PartitionError, match="partition 'speed' is unknown"):
        plan_stages(model, 2, "speed")
    with pytest.raises(PartitionError, match="cannot split a Linear: give an nn.Sequential or a list of blocks"):
        plan_stages(nn.Linear(2, 2), 2)


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_model_split_in_one_process_matches_the_unsplit_model(micro_batches):
    torch.manual_seed(0)
    x, y = torch.randn(10, FEATURES), torch.randint(0, CLASSES, (10,))
    ref = make_model()
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_loss = F.cross_entropy(ref(x), y)
    ref_loss.backward()
    opt.step()
    split = ModelSplit(make_model(), stages=2, devices=["cpu", "cpu"], micro_batches=micro_batches)
    opt = torch.optim.SGD(split.parameters(), lr=0.5)
    loss = F.cross_entropy(split(x), y.to(split.output_device))
    loss.backward()
    opt.step()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=TOL)
    for stage in split.stages:
        for name, p in stage.state_dict().items():
            assert rel(p - before[name], ref.state_dict()[name] - before[name]) < TOL, name
    with pytest.raises(ValueError, match="got 1 devices for 2 stages"):
        ModelSplit(make_model(), stages=2, devices=["cpu"])
    # its state dict is the model's, under the model's keys: it loads into a split cut elsewhere, and back
    assert list(split.state_dict()) == list(ref.state_dict())
    elsewhere = ModelSplit(make_model(), stages=2, devices=["cpu", "cpu"], partition=[len(split.plan.names) - 1])
    assert elsewhere.plan.bounds != split.plan.bounds
    elsewhere.load_state_dict(split.state_dict())
    assert all(torch.equal(v, split.state_dict()[k]) for k, v in elsewhere.state_dict().items())


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="Requires: [GPUs>=2]")
def test_model_split_over_two_gpus_matches_the_unsplit_model():
    torch.manual_seed(0)
    x, y = torch.randn(10, FEATURES), torch.randint(0, CLASSES, (10,))
    ref = make_model()
    ref_loss = F.cross_entropy(ref(x), y)
    ref_loss.backward()
    split = ModelSplit(make_model(), stages=2, devices=["cuda:0", "cuda:1"], micro_batches=2)
    assert split.output_device == torch.device("cuda", 1)
    loss = F.cross_entropy(split(x.cuda(0)), y.to(split.output_device))
    loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-4)   # GPU kernels may use TF32
    grad = split.stages[0][0].weight.grad.cpu()
    assert rel(grad, ref[0].weight.grad) < 1e-3


# -- real horovodrun jobs -----------------------------------------------------------------------

PIPELINE_CASES = [
    # (np, stages, schedule, micro-batches, p2p, what it covers)
    (2, 2, "gpipe", 4, "torch", "pp=2 dp=1, GPipe, uneven micro-batches 3,3,2,2"),
    (2, 2, "1f1b", 4, "torch", "pp=2 dp=1, 1F1B"),
    (2, 2, "1f1b", 4, "socket", "pp=2 dp=1, 1F1B over the socket link"),
    (2, 2, "1f1b", 3, "alltoall", "pp=2 dp=1, 1F1B over Horovod alltoall"),
    (2, 2, "gpipe", 2, "broadcast", "pp=2 dp=1, GPipe over Horovod broadcast"),
    (4, 2, "1f1b", 2, "torch", "pp=2 dp=2: gradients averaged per stage over replicas"),
    (4, 2, "gpipe", 4, "alltoall", "pp=2 dp=2 with pair process sets"),
    (4, 4, "1f1b", 4, "torch", "pp=4 dp=1: middle stages get only the batch size"),
    (4, 4, "zb-h1", 4, "socket", "pp=4 dp=1, zero bubble: each stage's weight halves 0-3 micro-batches late"),
    (4, 2, "1f1b-batched-w", 3, "socket",
     "pp=2 dp=2, batched weight gradients: one product per Linear over uneven micro-batches 4,3,3"),
]
# The generated models, split: (model, np, stages, schedule, micro-batches, clip norm, what it covers)
WORKLOAD_CASES = [
    ("resnet18", 2, 2, "1f1b", 4, 0.0, 1, "ResNet-18 pp=2, BatchNorm per micro-batch"),
    ("gpt", 4, 4, "gpipe", 2, 0.1, 1, "GPT pp=4 (one block a stage), gradients clipped by the whole model's norm"),
    ("gpt", 4, 2, "1f1b", 2, 0.1, 2, "GPT pp=2 x tp=2: each stage's blocks split over 2 ranks, clipped"),
    ("resnet18", 2, 2, "zb-h1", 4, 0.0, 1, "ResNet-18 pp=2, zero bubble: BatchNorm, in-place ReLU and sums in halves"),
    ("gpt", 4, 2, "zb-h1", 2, 0.1, 2, "GPT pp=2 x tp=2, zero bubble: the split layers' collectives in the input half"),
    ("resnet18", 2, 2, "1f1b-batched-w", 4, 0.0, 1,
     "ResNet-18 pp=2, batched weight gradients: convolutions and norms a micro-batch at a time, the head's Linear as one"),
]
WORKLOAD_BLOCKS = {"resnet18": [str(i) for i in range(10)], "gpt": [str(i) for i in range(4)]}
# Recomputed blocks (model.recompute: blocks) against the whole model that keeps its activations,
# each on the grid of a case here (its job): (model, np, stages, schedule, micro-batches, clip, tp, what)
RECOMPUTE_CASES = [
    ("gpt", 4, 2, "1f1b", 2, 0.1, 2, "recomputed GPT pp=2 x tp=2: the split layers' collectives again in backward"),
    ("resnet18", 2, 2, "zb-h1", 4, 0.0, 1,
     "recomputed ResNet-18 pp=2, zero bubble: BatchNorm updated once, weight halves recomputed"),
    ("mlp", 2, 2, "interleaved-1f1b", 4, 0.0, 1, "recomputed MLP pp=2 x 2 chunks"),
]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("np_,stages,schedule,m,p2p,what", PIPELINE_CASES, ids=[c[-1] for c in PIPELINE_CASES])
def test_pipeline_step_matches_single_process(pipeline_jobs, np_, stages, schedule, m, p2p, what):
    results, _ = pipeline_jobs(what)
    check_against_reference(results, np_, stages, schedule, m, ALL_BLOCKS)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("model,np_,stages,schedule,m,clip,tp,what", WORKLOAD_CASES, ids=[c[-1] for c in WORKLOAD_CASES])
def test_generated_models_split_into_a_pipeline_match_single_process(pipeline_jobs, model, np_, stages,
                                                                     schedule, m, clip, tp, what):
    results, _ = pipeline_jobs(what)
    check_against_reference(results, np_, stages, schedule, m, WORKLOAD_BLOCKS[model], tp=tp)
    assert all(all(r["clipped"]) for r in results) if clip else not any(any(r["clipped"]) for r in results)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("model,np_,stages,schedule,m,clip,tp,what", RECOMPUTE_CASES, ids=[c[-1] for c in RECOMPUTE_CASES])
def test_recomputed_blocks_match_the_unsplit_model(pipeline_jobs, model, np_, stages, schedule, m, clip, tp, what):
    results, _ = pipeline_jobs(what)
    blocks = ALL_BLOCKS if model == "mlp" else WORKLOAD_BLOCKS[model]
    check_against_reference(results, np_, stages, schedule, m, blocks, tp=tp,
                            chunks=2 if schedule == "interleaved-1f1b" else 1)
    assert all(all(r["clipped"]) for r in results) if clip else not any(any(r["clipped"]) for r in results)


# horovod.zero 1 over each stage's replicas, SGD with momentum (a state to shard), each on the grid
# of a case above: (model, np, stages, schedule, micro-batches, p2p, clip, what)
ZERO_CASES = [
    ("mlp", 4, 2, "1f1b", 2, "torch", 0.0, "pp=2 dp=2 ZeRO 1: each replica steps its rows of the stage"),
    ("gpt", 4, 2, "1f1b", 2, "torch", 0.1, "GPT pp=2 dp=2 ZeRO 1, clipped by the norm of every rank's rows"),
    ("mlp", 4, 2, "1f1b-batched-w", 3, "socket", 0.0, "pp=2 dp=2 ZeRO 1, batched weight gradients"),
]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("model,np_,stages,schedule,m,p2p,clip,what", ZERO_CASES, ids=[c[-1] for c in ZERO_CASES])
def test_zero_pipeline_stages_match_the_unsplit_model(pipeline_jobs, model, np_, stages, schedule, m, p2p, clip, what):
    """Two steps of pipeline stages whose replicas each hold half of the stage's optimizer state
    (momentum) equal the whole model's, momentum and all."""
    results, _ = pipeline_jobs(what)
    check_against_reference(results, np_, stages, schedule, m, ALL_BLOCKS if model == "mlp" else WORKLOAD_BLOCKS[model])
    assert all(all(r["clipped"]) for r in results) if clip else not any(any(r["clipped"]) for r in results)
    for r in results:
        assert abs(r["optimizer_share"] - 1 / (np_ // stages)) < 0.05, (r["rank"], r["optimizer_share"])


INTERLEAVED_CASES = [
    # (np, stages, chunks, micro-batches, p2p, model, clip norm, what it covers)
    (2, 2, 2, 4, "socket", "mlp", 0.0, "pp=2, 2 chunks a rank: two socket links between the same pair, one each way round"),
    (3, 3, 2, 6, "torch", "mlp", 0.0, "pp=3, 2 chunks: the last stage hands each micro-batch to the first's chunk 1"),
    (4, 2, 3, 2, "alltoall", "mlp", 0.0, "pp=2 dp=2, 3 chunks over Horovod alltoall, averaged per stage"),
    (2, 2, 2, 4, "socket", "resnet18", 0.0, "ResNet-18 pp=2 x 2 chunks: BatchNorm per micro-batch in every chunk"),
    (2, 2, 2, 2, "socket", "gpt", 0.1, "GPT pp=2 x 2 chunks (a block each), clipped by the whole model's norm"),
]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("np_,stages,chunks,m,p2p,model,clip,what", INTERLEAVED_CASES,
                         ids=[c[-1] for c in INTERLEAVED_CASES])
def test_interleaved_pipeline_matches_single_process(pipeline_jobs, np_, stages, chunks, m, p2p, model, clip, what):
    """Interleaved 1F1B: each rank holds `chunks` pieces of the model (virtual stages r, r+p, ...)."""
    results, _ = pipeline_jobs(what)
    blocks = ALL_BLOCKS if model == "mlp" else WORKLOAD_BLOCKS[model]
    check_against_reference(results, np_, stages, "interleaved-1f1b", m, blocks, chunks=chunks)
    assert all(all(r["clipped"]) for r in results) if clip else not any(any(r["clipped"]) for r in results)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipeline_after_hvd_init_adds_process_sets_dynamically(tmp_path):
    out = tmp_path / "result.json"
    args = [sys.executable, str(SCRIPTS / "pipeline_step.py"), "--schedule", "gpipe", "--micro-batches", "2",
            "--p2p", "alltoall", "--hvd-init-first", "--out", str(out)]
    run_horovod(4, args, cwd=tmp_path, timeout=280, env=bench_links(HOROVOD_DYNAMIC_PROCESS_SETS="1"))
    check_against_reference(json.loads(out.read_text()), 4, 2, "gpipe", 2, ALL_BLOCKS)
    # without dynamic process sets, the job stops at start-up and says what to do
    failed = run_horovod(4, args, cwd=tmp_path, timeout=280, check=False, env=bench_links())
    assert failed.returncode != 0
    assert "Horovod is already initialised: call init_pipeline() instead of hvd.init()" in failed.stdout + failed.stderr


TIMELINES = {   # schedule: (what each micro-batch computes, the theory line, activations held per stage)
    "1f1b": (("forward", "backward"), "theory   bubble 0.200", "stage 0: 2, stage 1: 1 (theory: at most 2)"),
    "zb-h1": (("forward", "backward_input", "backward_weight"), "theory   bubble 0.077",
              "stage 0: 2, stage 1: 2 (theory: at most 2)"),
    # 2 chunks a rank: each micro-batch's forward and backward twice on every rank, twice the messages
    "interleaved-1f1b": (("forward", "backward"), "theory   bubble 0.111 = (p-1)/(vm+p-1), v = 2 chunks",
                         "stage 0: 5, stage 1: 3 (theory: at most 5)"),
}
TIMELINE_SPLITS = {"1f1b": "4", "zb-h1": "4", "interleaved-1f1b": "2,4,6"}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("schedule", TIMELINES)
def test_pipeline_records_a_timeline_the_cli_can_draw(pipeline_jobs, schedule):
    """Also the zero-bubble schedule's plain case (pp=2 dp=1, equal to the whole model)."""
    chunks = timeline_chunks(schedule)
    results, run = pipeline_jobs(f"timeline: {schedule}")
    check_against_reference(results, 2, 2, schedule, 4, ALL_BLOCKS, chunks=chunks)
    if chunks == 1:
        assert [r["blocks"] for r in results] == [["0", "1", "2", "3"], ["4", "5", "6"]]
    else:
        assert [r["chunk_blocks"] for r in results] == [[["0", "1"], ["4", "5"]], [["2", "3"], ["6"]]]
    tl = load_timeline(run)
    assert tl.meta == {"schedule": schedule, "stages": 2, "replicas": 1, "micro_batches": 4, "chunks": chunks}
    assert tl.steps == [0, 1, 2]          # training steps only: evaluation is not recorded
    computed, theory, held = TIMELINES[schedule]
    for rank in tl.ranks:
        for step in tl.steps:
            kinds = [(e["kind"], e["mb"], e.get("chunk", 0)) for e in rank["events"] if e["step"] == step]
            for kind in computed:
                assert sorted((c, mb) for k, mb, c in kinds if k == kind) == [(c, i) for c in range(chunks)
                                                                              for i in range(4)]
            assert {k for k, _, _ in kinds} - {"idle"} == {*computed, "send", "recv"}
            # a rank sends and receives once per micro-batch and chunk, but for the model's two ends
            messages = 4 * (2 * chunks - 1)
            assert sum(k == "send" for k, _, _ in kinds) == messages and sum(k == "recv" for k, _, _ in kinds) == messages
    # the schedule replayed with these steps' compute times and free messages can only be shorter
    for step in tl.steps:
        assert 0.0 <= step_replayed_bubble(tl, step) <= step_bubble(tl, step) + 1e-9
    result = CliRunner().invoke(cli, ["timeline", str(run)])
    assert result.exit_code == 0, result.output
    assert theory in result.output and (run / "timeline.png").exists()
    assert f"micro-batches in flight, step 2: {held}" in result.output
    assert f"replayed bubble {replayed_bubble(tl):.3f}: " in result.output


def timeline_chunks(schedule: str) -> int:
    return 2 if schedule == "interleaved-1f1b" else 1


# Every case above, by its id, as (the job's grid, the case's own flags): the cases of one grid run
# in one job (tests/helpers/pipeline_jobs.py), each checked by its test.
def grid(np_: int, stages: int, p2p: str = "torch", tp: int = 1, chunks: int = 1) -> tuple:
    return np_, stages, p2p, tp, chunks


JOB_CASES: dict[str, tuple[tuple, dict]] = {}
for np_, stages, schedule, m, p2p, what in PIPELINE_CASES:
    JOB_CASES[what] = grid(np_, stages, p2p), {"schedule": schedule, "micro_batches": m}
for model, np_, stages, schedule, m, clip, tp, what in WORKLOAD_CASES:
    JOB_CASES[what] = grid(np_, stages, tp=tp), {"schedule": schedule, "micro_batches": m, "model": model,
                                                 "clip_norm": clip, "batch": 8}
for model, np_, stages, schedule, m, clip, tp, what in RECOMPUTE_CASES:
    JOB_CASES[what] = grid(np_, stages, "socket" if model == "mlp" else "torch", tp=tp,
                           chunks=2 if schedule == "interleaved-1f1b" else 1), {
        "schedule": schedule, "micro_batches": m, "clip_norm": clip, "recompute": True,
        **({} if model == "mlp" else {"model": model, "batch": 8})}
for np_, stages, chunks, m, p2p, model, clip, what in INTERLEAVED_CASES:
    JOB_CASES[what] = grid(np_, stages, p2p, chunks=chunks), {
        "schedule": "interleaved-1f1b", "micro_batches": m, "clip_norm": clip,
        **({} if model == "mlp" else {"model": model, "batch": 8})}
for model, np_, stages, schedule, m, p2p, clip, what in ZERO_CASES:
    JOB_CASES[what] = grid(np_, stages, p2p), {"schedule": schedule, "micro_batches": m, "clip_norm": clip, "zero": 1,
                                               "momentum": 0.9, **({} if model == "mlp" else {"model": model, "batch": 8})}
for schedule in TIMELINES:
    JOB_CASES[f"timeline: {schedule}"] = grid(2, 2, chunks=timeline_chunks(schedule)), {
        "schedule": schedule, "micro_batches": 4, "steps": 3, "partition": TIMELINE_SPLITS[schedule], "run_dir": True}
assert len(JOB_CASES) == (len(PIPELINE_CASES) + len(WORKLOAD_CASES) + len(RECOMPUTE_CASES) + len(INTERLEAVED_CASES)
                          + len(ZERO_CASES) + len(TIMELINES))


@pytest.fixture(scope="module")
def pipeline_jobs(tmp_path_factory, workload_projects):
    """results(case id) -> (every rank's results, the case's run folder): the first case asked for
    of a grid runs that grid's job, all its cases; the others read theirs."""
    return grid_jobs(tmp_path_factory.mktemp("pipeline_jobs"), SCRIPTS / "pipeline_step.py", JOB_CASES,
                     workload_projects)


MODEL_SPLIT_CASES = [
    # (model, clip norm, steps, what it covers)
    ("mlp", 0.0, 2, "MLP, 3 micro-batches"),
    # One step: BatchNorm over micro-batches of 3 or 4 images is ill-conditioned enough that a
    # second SGD step magnifies fp32 rounding (1e-7 after one step) to within a hair of 1e-5.
    ("resnet18", 0.0, 1, "ResNet-18: BatchNorm per worker and micro-batch"),
    ("gpt", 0.1, 2, "GPT, gradients clipped after the allreduce"),
]


@pytest.fixture(scope="module")
def model_split_results(tmp_path_factory, workload_projects) -> dict[str, list[dict]]:
    """Every MODEL_SPLIT_CASES case's results (every rank's), all from one horovodrun job."""
    return model_split_job(tmp_path_factory.mktemp("model_split"), SCRIPTS / "model_split_step.py", MODEL_SPLIT_CASES, workload_projects)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model,clip,steps,what", MODEL_SPLIT_CASES, ids=[c[-1] for c in MODEL_SPLIT_CASES])
def test_model_split_with_horovod_data_parallel_matches_single_process(model_split_results, model, clip, steps, what):
    results = model_split_results[what]
    assert len(results) == 2
    for r in results:
        for got, want in zip(r["losses"], r["ref_losses"]):
            assert abs(got - want) <= TOL * abs(want)
        assert sorted(r["update_err"]) == r["params"]
        assert max(r["update_err"].values()) < TOL, max(r["update_err"].items(), key=lambda kv: kv[1])
        assert len(r["losses"]) == steps
        assert all(r["clipped"]) if clip else r["clipped"] == []

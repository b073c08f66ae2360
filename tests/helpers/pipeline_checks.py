"""The judgement of a pipeline step run against its single-process reference, for either framework.

The step scripts (tests/distributed/scripts/*pipeline_step.py) write one JSON record per rank:
its losses, accuracies and validation loss next to the reference's, the relative error of each
of its parameters' update, its blocks, and the most micro-batches it held at once.
"""

import pytest

from hvd_runtime.pipeline.schedule import SPLIT_BACKWARD, theory_peak_in_flight

TOL = 1e-5   # relative, fp32


def check_against_reference(results, np, stages, schedule, m, all_blocks, tp=1, chunks=1):
    assert sorted(r["rank"] for r in results) == list(range(np))
    for r in results:
        # activations held at once: GPipe all m, 1F1B at most p - stage, ZB-H1 p on every stage
        assert r["peak_in_flight"] == theory_peak_in_flight(schedule, stages, m, r["stage"], chunks)
        if r.get("weights_put_off") is not None:   # zero bubble: every weight waited for the second half
            assert schedule in SPLIT_BACKWARD and r["weights_put_off"] == r["weights"], (r["rank"], r["weights_put_off"])
        if schedule == "1f1b-batched-w" and r.get("linears_batched") is not None and m > 1:
            # every plain Linear's weight gradient went as one product over the step's micro-batches
            assert r["linears_batched"] == r["linears"], (r["rank"], r["linears_batched"], r["linears"])
        for got, want in zip(r["losses"], r["ref_losses"]):
            assert abs(got - want) <= TOL * abs(want), (r["rank"], r["losses"], r["ref_losses"])
        assert r["accs"] == pytest.approx(r["ref_accs"], abs=1e-6)
        assert abs(r["val_loss"] - r["ref_val_loss"]) <= TOL * abs(r["ref_val_loss"])
        if r["update_err"]:  # a weight-free stage (a flatten) has no parameters to compare
            worst = max(r["update_err"].items(), key=lambda kv: kv[1])
            assert worst[1] < TOL, f"rank {r['rank']}: parameter {worst[0]} update off by {worst[1]:.2e} (relative)"
    # every block of the model was compared, on every replica and every tensor-parallel slice
    lanes = {(r["replica"], r.get("tp_rank", 0)) for r in results}
    assert len(lanes) == np // stages and {t for _, t in lanes} == set(range(tp))
    for lane in lanes:
        ranks = sorted((r for r in results if (r["replica"], r.get("tp_rank", 0)) == lane), key=lambda r: r["stage"])
        if chunks > 1:   # the model's pieces in order: chunk 0 of every stage, then chunk 1, ...
            assert all(len(r["chunk_blocks"]) == chunks for r in ranks)
            assert [b for c in range(chunks) for r in ranks for b in r["chunk_blocks"][c]] == list(all_blocks)
        else:
            assert [b for r in ranks for b in r["blocks"]] == list(all_blocks)
        assert [r["stage"] for r in ranks] == list(range(stages))
    if tp > 1:  # the split layers were split, and compared slice against slice
        assert all(r["sliced_params"] for r in results if r["update_err"])

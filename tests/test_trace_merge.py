"""Merging the rank traces of a run: partitioned tensors equal the statistics of the
concatenated tensors, replicated ones are checked equal and taken once, scales kept per rank;
analyze and replay accept the run's record directory."""

import numpy as np
import pytest
import torch

from fp8sim.trace import TraceReader, TraceWriter
from fp8sim.trace.merge import merge_rank_traces, rank_trace_dirs, read_rank_scales

STEPS = (1, 2, 3)


def _data(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    act = torch.randn(6 + rank, 16, generator=g) * 2.0 ** (4 * rank - 6)  # ranks far apart in range
    act[0, 0] = float("nan") if (rank, step) == (1, 2) else act[0, 0]
    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)  # same on every rank
    return {"l0.input": act, "l0.weight": w, "l0.weight_grad": torch.randn(8, 16, generator=g) * 1e-3}


ROLES = {"l0.input": ("activation", "e4m3"), "l0.weight": ("weight", "e4m3"), "l0.weight_grad": ("weight_grad", "e5m2")}


def _write(path, tensors_by_step, scale_of):
    with TraceWriter(path, {"rank": 0}, chunk_steps=2) as w:
        for name, (role, fmt) in ROLES.items():
            w.add_tensor(name, role, fmt, tuple(tensors_by_step[1][name].shape))
        for step in STEPS:
            for name, x in tensors_by_step[step].items():
                w.record(step, name, x, scale=scale_of(name, step))
                if step == 2:
                    w.save_tensor(step, name, x)


def _run(tmp_path, world=2, scale_of=lambda r: (lambda n, s: 2.0 ** (s - r))):
    run = tmp_path / "record"
    for r in range(world):
        _write(run / f"rank{r}", {s: _data(r, s) for s in STEPS}, scale_of(r))
    return run


def test_partitioned_equals_the_concatenated_tensors(tmp_path):
    run = _run(tmp_path)
    merged = TraceReader(merge_rank_traces(run, tmp_path / "merged"))
    # the independent reference: one trace of the tensors concatenated over the ranks, each
    # rank's part cast with its own scale (the counts are per element, so they add up)
    for step in STEPS:
        cat = torch.cat([_data(r, step)["l0.input"] for r in range(2)])
        one = tmp_path / f"one{step}"
        with TraceWriter(one, {}) as w:
            w.add_tensor("x", "activation", "e4m3", tuple(cat.shape))
            w.record(step, "x", cat, scale=1.0)
        ref = TraceReader(one).record(step, "x")
        got = merged.record(step, "l0.input")
        np.testing.assert_array_equal(got.hist.bins, ref.hist.bins)
        np.testing.assert_array_equal(got.hist.counts, ref.hist.counts)
        assert (got.numel, got.zero, got.nan, got.inf) == (ref.numel, ref.zero, ref.nan, ref.inf)
        assert got.amax == ref.amax == float(cat.nan_to_num(0).abs().max())
        per = [TraceReader(run / f"rank{r}").record(step, "l0.input") for r in range(2)]
        assert got.overflow == sum(p.overflow for p in per) and got.underflow == sum(p.underflow for p in per)
        assert got.scale == per[1].scale  # rank 1 holds the amax: its scale
    assert merged.tensor("l0.input").shape == (13, 16)
    torch.testing.assert_close(merged.load_tensor(2, "l0.input"), torch.cat([_data(r, 2)["l0.input"] for r in range(2)]),
                               rtol=0, atol=0, equal_nan=True)
    scales = read_rank_scales(tmp_path / "merged")
    assert scales[(3, "l0.input")].tolist() == [8.0, 4.0]
    assert merged.config["merged"]["ranks"] == 2 and "rank" not in merged.config


def test_replicated_taken_once_and_checked(tmp_path):
    run = _run(tmp_path, scale_of=lambda r: (lambda n, s: 1.0))
    merged = TraceReader(merge_rank_traces(run, tmp_path / "merged"))
    one = TraceReader(run / "rank0").record(2, "l0.weight")
    got = merged.record(2, "l0.weight")
    assert (got.numel, got.amax, got.scale) == (one.numel, one.amax, one.scale) == (128, got.amax, 1.0)
    assert merged.tensor("l0.weight").shape == (8, 16)
    # a replicated tensor that differs between ranks is refused, by name
    bad = tmp_path / "bad"
    for r in range(2):
        data = {s: _data(r, s) for s in STEPS}
        data[3]["l0.weight"] = data[3]["l0.weight"] * (1 + r)
        _write(bad / f"rank{r}", data, lambda n, s: 1.0)
    with pytest.raises(ValueError, match=r"'l0.weight' at step 3 is replicated but rank 1's statistics differ"):
        merge_rank_traces(bad, tmp_path / "m2")
    assert not (tmp_path / "m2").exists()


def test_rank_directories_are_checked(tmp_path):
    run = _run(tmp_path, world=3)
    (run / "rank1" / "trace.json").rename(run / "rank1" / "x.json")
    with pytest.raises(ValueError, match="rank1 missing"):
        rank_trace_dirs(run)
    assert rank_trace_dirs(run / "rank0") is None
    with pytest.raises(ValueError, match="exists"):
        merge_rank_traces(_run(tmp_path / "b"), run)


def test_analyze_and_replay_take_the_run_directory(tmp_path):
    from fp8sim.analysis import analyze, replay

    run = _run(tmp_path)
    merged = merge_rank_traces(run, tmp_path / "merged")
    a, b = analyze(str(run)), analyze(str(merged))
    assert [t.to_dict()["tensors"] for t in a.traces] == [
        [dict(r, file=str(run)) for r in t.to_dict()["tensors"]] for t in b.traces]
    assert any("merged 2 rank traces" in n.note for n in a.notes)
    ra, rb = replay(str(run), ["current"]), replay(str(merged), ["current"])
    assert [p.to_dict() for p in ra.policies] == [p.to_dict() for p in rb.policies]
    assert ra.trace == str(run)

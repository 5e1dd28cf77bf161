"""Edge cases of the simulated FP8 all-reduce and its replay: a NaN on one rank (the result must
not depend on which rank holds it, and the error figures read undefined, never a perfect SNR),
and the rank directories ``replay --allreduce`` accepts (rank<N> exactly, 0 .. N-1 without gaps,
stray ``rank*`` directories ignored with a note, duplicates such as rank01/ beside rank1/ refused)."""

import json
import math
import shutil
from dataclasses import asdict

import numpy as np
import pytest
import torch

from fp8sim import cli
import fp8sim
from fp8sim.scaling import scale_from_amax
from fp8sim.trace import TraceWriter
from fp8sim.allreduce_sim import (
    METHODS,
    REDUCTIONS,
    error_figures,
    global_amax,
    simulate_allreduce,
)
from fp8sim.analysis.allreduce_replay import format_allreduce_report, replay_allreduce

E4M3 = fp8sim.get_format("e4m3")
NAN = float("nan")


def _same(a, b):
    """Equal, NaN equal to NaN (dicts, lists, floats)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _pair(seed=0, n=1000):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, generator=g) * 1e-3
    b = torch.randn(n, generator=g) * 1e-3
    b_nan = b.clone()
    b_nan[3] = NAN
    return a, b, b_nan


# -- bug 1: NaN on one rank -------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("reduce", REDUCTIONS)
def test_which_rank_holds_the_nan_does_not_matter(method, reduce):
    a, _, b_nan = _pair()
    avg1, st1 = simulate_allreduce([a, b_nan], method=method, reduce=reduce)
    avg2, st2 = simulate_allreduce([b_nan, a], method=method, reduce=reduce)
    assert _same(asdict(st1), asdict(st2))
    torch.testing.assert_close(avg1, avg2, rtol=0, atol=0, equal_nan=True)


def test_exact_sum_does_not_depend_on_rank_order_with_nan_on_any_rank():
    a, b, b_nan = _pair(seed=1)
    c = -b
    perms = [[a, b_nan, c], [b_nan, a, c], [c, a, b_nan], [a, c, b_nan]]
    for method in METHODS:
        first = asdict(simulate_allreduce(perms[0], method=method)[1])
        for p in perms[1:]:
            assert _same(asdict(simulate_allreduce(p, method=method)[1]), first)


def test_nan_rank_does_not_decide_the_scale():
    """The documented rule: per-rank amax propagates NaN, the MAX across ranks skips it (NCCL's
    fmaxf), so k is the one of the ranks without NaN; no underflow flood from a scale of 1."""
    a, b, b_nan = _pair()
    want_amax = float(torch.maximum(a.abs().max(), b[~torch.isnan(b_nan)].abs().max()))
    assert global_amax([a, b_nan]) == global_amax([b_nan, a]) == want_amax
    s = float(scale_from_amax(np.float32(want_amax), E4M3))
    for grads in ([a, b_nan], [b_nan, a]):
        _, pre = simulate_allreduce(grads, method="pre")
        _, post = simulate_allreduce(grads, method="post")
        assert pre.k == float(np.float32(s / 2)) and post.k == s
        # the same scale as without the NaN: the same underflow (one more nonzero input, the NaN)
        _, clean = simulate_allreduce([a, b], method="pre")
        assert pre.underflow_in == clean.underflow_in and pre.nonzero_in == clean.nonzero_in
        assert pre.underflow_share < 0.01  # was 95% with the NaN on rank 0 (scale 1)
        # the NaN reaches the average (that element only) and makes the error undefined
        avg, st = simulate_allreduce(grads, method="pre")
        assert torch.isnan(avg).sum() == 1 and math.isnan(st.rel_error) and math.isnan(st.snr_db)


def test_global_amax_all_nan_inf_and_empty():
    nan = torch.tensor([1.0, NAN])
    assert math.isnan(global_amax([nan, nan]))
    assert global_amax([torch.tensor([2.0, -np.inf]), nan]) == math.inf
    assert global_amax([torch.zeros(0), torch.zeros(0)]) == 0.0
    assert global_amax([torch.tensor([-3.0]), torch.tensor([0.5])]) == 3.0
    _, st = simulate_allreduce([nan, nan], method="pre")  # every rank NaN: scale 1 (amax NaN)
    assert st.k == 0.5 and math.isnan(st.rel_error) and math.isnan(st.snr_db)


@pytest.mark.parametrize(
    "err, nref, want",
    [
        (0.0, 0.0, (0.0, math.inf)),
        (0.0, 2.0, (0.0, math.inf)),
        (1.0, 0.0, (math.inf, -math.inf)),
        (math.inf, 1.0, (math.inf, -math.inf)),
        (1.0, math.inf, (0.0, math.inf)),
        (NAN, 1.0, (NAN, NAN)),
        (1.0, NAN, (NAN, NAN)),
        (NAN, 0.0, (NAN, NAN)),
        (math.inf, math.inf, (NAN, NAN)),
        (1.0, 10.0, (0.1, 20.0)),
    ],
)
def test_error_figures_never_disagree(err, nref, want):
    rel, snr = error_figures(err, nref)
    assert _same([rel, snr], list(want)) or (rel == pytest.approx(want[0]) and snr == pytest.approx(want[1]))
    assert not (math.isnan(rel) and not math.isnan(snr))
    assert not (rel != 0 and snr == math.inf)


def _write_traces(root, grads_by_rank, names=("w.weight_grad",), steps=(1,)):
    """rank traces: grads_by_rank[r][name][step] -> tensor."""
    for r, by_name in grads_by_rank.items():
        with TraceWriter(root / f"rank{r}", {"rank": r}) as tw:
            for name in names:
                tw.add_tensor(name, "weight_grad", "e4m3", tuple(by_name[name][steps[0]].shape))
            for step in steps:
                for name in names:
                    x = by_name[name][step]
                    tw.record(step, name, x, scale=1.0)
                    tw.save_tensor(step, name, x)


def _nan_traces(root, nan_rank):
    """Two ranks, two tensors over two steps; rank ``nan_rank`` holds a NaN in one (step, tensor)."""
    torch.manual_seed(3)
    names, steps = ("a.weight_grad", "b.weight_grad"), (1, 2)
    base = {r: {n: {s: torch.randn(8, 16) * 1e-3 for s in steps} for n in names} for r in range(2)}
    grads = {0: base[0], 1: base[1]} if nan_rank == 1 else {0: base[1], 1: base[0]}  # swap the ranks
    grads[nan_rank]["a.weight_grad"][2] = grads[nan_rank]["a.weight_grad"][2].clone()
    grads[nan_rank]["a.weight_grad"][2][0, 0] = NAN
    _write_traces(root, grads, names, steps)


def test_replay_with_a_nan_on_either_rank_gives_the_same_table(tmp_path):
    _nan_traces(tmp_path / "r1", nan_rank=1)
    _nan_traces(tmp_path / "r0", nan_rank=0)
    res1, res0 = replay_allreduce(tmp_path / "r1", 2), replay_allreduce(tmp_path / "r0", 2)
    assert _same(res1["rows"], res0["rows"])
    assert format_allreduce_report(res1) == format_allreduce_report(res0).replace(str(tmp_path / "r0"), "")
    for row in res1["rows"]:
        assert row["nan_records"] == 1
        assert math.isnan(row["rel_error_mean"]) and math.isnan(row["rel_error_max"])
        assert math.isnan(row["snr_db_mean"])  # undefined like the error: not inf, not a finite mean
        assert row["underflow_share"] < 0.05  # the NaN rank's amax does not set the scale


def test_table_and_json_show_no_inf_snr_next_to_a_nan_error(tmp_path, capsys):
    _nan_traces(tmp_path, nan_rank=0)
    text = format_allreduce_report(replay_allreduce(tmp_path, 2))
    table = [ln for ln in text.splitlines() if ln.split()[:1] and ln.split()[0] in METHODS]
    assert len(table) == 8
    for ln in table:
        assert "inf" not in ln and ln.split()[-3:] == ["nan", "nan", "nan"]  # rel err, max, SNR
    assert "note: 1 (step, tensor) records hold NaN" in text
    assert cli.main(["replay", str(tmp_path), "--allreduce", "2", "--json", "-"]) == 0
    out = capsys.readouterr().out
    assert "Infinity" not in out and "NaN" not in out  # strict JSON
    for row in json.loads(out)["rows"]:
        assert row["rel_error_mean"] is None and row["snr_db_mean"] is None and row["nan_records"] == 1


def test_all_nan_records_row_snr_is_nan_not_inf(tmp_path):
    """Before: the row SNR was the mean over finite records, inf when none was finite."""
    torch.manual_seed(4)
    g = {r: {"w.weight_grad": {1: torch.full((4, 4), NAN)}} for r in range(2)}
    _write_traces(tmp_path, g)
    for row in replay_allreduce(tmp_path, 2)["rows"]:
        assert math.isnan(row["rel_error_mean"]) and math.isnan(row["snr_db_mean"])


def test_exact_records_keep_an_inf_snr(tmp_path):
    x = torch.tensor([[1.0, -0.5], [0.25, 0.0]])  # E4M3 values that scale and sum exactly
    _write_traces(tmp_path, {r: {"w.weight_grad": {1: x}} for r in range(2)})
    res = replay_allreduce(tmp_path, 2, methods=["pre"], reductions=["exact"])  # k = 224: no rounding
    row = res["rows"][0]
    assert row["rel_error_mean"] == 0.0 and row["snr_db_mean"] == math.inf and row["nan_records"] == 0
    assert "records hold NaN" not in format_allreduce_report(res)


# -- bug 2: which directories are ranks -------------------------------------------------------


def _rank_traces(root, ranks=(0, 1), seed=0):
    g = torch.Generator().manual_seed(seed)
    grads = {r: {"w.weight_grad": {1: torch.randn(8, 8, generator=g) * 1e-2}} for r in ranks}
    _write_traces(root, grads)


def _one_row(path, n=2):
    return replay_allreduce(path, n, methods=["pre"], reductions=["exact"])


def test_stray_rank_bak_directory_is_ignored_with_a_note(tmp_path, capsys):
    _rank_traces(tmp_path / "clean")
    _rank_traces(tmp_path / "run")
    shutil.copytree(tmp_path / "run" / "rank1", tmp_path / "run" / "rank1.bak")
    (tmp_path / "run" / "rank").mkdir()  # no number at all (was read as rank 0)
    res, clean = _one_row(tmp_path / "run"), _one_row(tmp_path / "clean")
    assert _same(res["rows"], clean["rows"]) and clean["notes"] == []
    assert len(res["notes"]) == 1 and "rank/, rank1.bak/" in res["notes"][0] and "ignored" in res["notes"][0]
    assert "note: ignored rank/, rank1.bak/" in format_allreduce_report(res)
    rc = cli.main(["replay", str(tmp_path / "run"), "--allreduce", "2"])
    out, err = capsys.readouterr()
    assert rc == 0 and "note: ignored rank/, rank1.bak/" in out and "invalid literal" not in out + err


@pytest.mark.parametrize("dup, of", [("rank01", "rank1"), ("rank00", "rank0"), ("rank001", "rank1")])
def test_leading_zero_duplicate_of_a_rank_is_refused(tmp_path, capsys, dup, of):
    _rank_traces(tmp_path)
    shutil.copytree(tmp_path / of, tmp_path / dup)
    with pytest.raises(ValueError, match=rf"{dup}/ and {of}/ both hold traces of rank {int(of[4:])}"):
        _one_row(tmp_path)
    rc = cli.main(["replay", str(tmp_path), "--allreduce", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "both hold traces" in err and "invalid literal" not in err


def test_leading_zero_name_alone_is_not_taken_as_the_rank(tmp_path):
    _rank_traces(tmp_path)
    (tmp_path / "rank1").rename(tmp_path / "rank01")
    with pytest.raises(ValueError, match=r"missing rank1/ \(found rank0/; ignored rank01/\)"):
        _one_row(tmp_path)


def test_ranks_must_run_from_0_without_gaps(tmp_path):
    _rank_traces(tmp_path, ranks=(0, 2))
    want = r"asks for 2, which needs rank0/ .. rank1/: missing rank1/ \(found rank0/, rank2/\)"
    with pytest.raises(ValueError, match=want):
        _one_row(tmp_path)
    _rank_traces(tmp_path, ranks=(1,))  # now 0, 1, 2: fine for 2 and 3
    assert _one_row(tmp_path)["records"] == 1 and _one_row(tmp_path, 3)["ranks"] == 3
    shutil.rmtree(tmp_path / "rank0")
    with pytest.raises(ValueError, match="missing rank0/"):
        _one_row(tmp_path)


def test_more_ranks_than_asked_uses_the_first_ones(tmp_path):
    _rank_traces(tmp_path / "four", ranks=(0, 1, 2, 3), seed=5)
    _rank_traces(tmp_path / "two", ranks=(0, 1), seed=5)
    assert _same(_one_row(tmp_path / "four")["rows"], _one_row(tmp_path / "two")["rows"])
    assert _one_row(tmp_path / "four")["notes"] == []


def test_a_rank_directory_that_is_not_a_trace_is_named(tmp_path):
    _rank_traces(tmp_path, ranks=(0,))
    (tmp_path / "rank1").mkdir()
    with pytest.raises(ValueError, match=r"not an fp8sim trace: rank1/"):
        _one_row(tmp_path)
    (tmp_path / "rank1").rmdir()
    _rank_traces(tmp_path / "x", ranks=(0, 1))
    (tmp_path / "x" / "rank2").mkdir()  # beyond the ranks asked for: unused
    assert _one_row(tmp_path / "x")["records"] == 1


def test_only_stray_directories_is_not_a_rank_run(tmp_path):
    _rank_traces(tmp_path, ranks=(0,))
    (tmp_path / "rank0").rename(tmp_path / "rank0.old")
    with pytest.raises(ValueError, match=r"not an fp8sim trace nor a directory of rank0/ .*ignored rank0\.old/"):
        _one_row(tmp_path)

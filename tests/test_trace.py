"""fp8sim.trace: exact over/underflow from the |x| histogram, writer/reader round trips, atomicity.

The oracle for over/underflow is an obviously-correct float64 rounding written here (unbounded
exponent range, so "rounds above max" is visible for every format), cross-checked against
ml_dtypes (round-to-nearest-even, non-saturating) and, once it exists, fp8sim.quantize.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest
import torch

from fp8sim.formats import get_format
from fp8sim.trace import (
    AbsHistogram,
    TraceReader,
    TraceWriter,
    abs_histogram,
    cast_thresholds,
    is_trace,
)

FORMATS = ["e4m3", "e5m2", "e3m4", "e4m3fnuz", "e5m2fnuz", "e4m3b11fnuz", "e2m3", "e3m2", "e2m1"]
ML = {
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e3m4": ml_dtypes.float8_e3m4,
    "e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
    "e4m3b11fnuz": ml_dtypes.float8_e4m3b11fnuz,
}


def ref_round(p: np.ndarray, fmt_name: str, rounding: str = "rne") -> np.ndarray:
    """|p| rounded to fmt's precision with an unbounded exponent above (float64, exact)."""
    f = get_format(fmt_name)
    a = np.abs(p.astype(np.float64))
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    # log2 may be off by one next to a power of two; fix it exactly
    e = np.where(2.0**e > a, e - 1, e)
    e = np.where(2.0 ** (e + 1) <= a, e + 1, e)
    ulp = 2.0 ** (np.maximum(e, f.emin) - f.mantissa_bits)
    with np.errstate(invalid="ignore"):
        v = a / ulp  # exact: a power-of-two division
    if rounding == "rne":
        r = np.round(v)  # half to even
    elif rounding == "rna":
        r = np.floor(v + 0.5)
    else:
        r = np.floor(v)
    return np.where(a > 0, r * ulp, 0.0)


def ref_counts(x32: np.ndarray, scale: float, fmt_name: str, rounding: str = "rne"):
    """(overflow, underflow) of encode(float32(float32(x) * float32(scale))), float64 reference."""
    f = get_format(fmt_name)
    fin = np.isfinite(x32)
    with np.errstate(over="ignore"):
        p = (x32[fin].astype(np.float64) * np.float64(np.float32(scale))).astype(np.float32)
    q = ref_round(p, fmt_name, rounding)
    over = (~np.isfinite(p)) | (q > f.max)
    under = (x32[fin] != 0) & (q == 0)
    return int(over.sum()), int(under.sum())


def planted(rng: np.random.Generator, n: int = 20000) -> np.ndarray:
    """Random float32 magnitudes over ~60 binades, signs, zeros, NaN/inf, and every format's
    over/underflow thresholds (and their float32 neighbours) at many power-of-two scales."""
    x = rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n))
    extra = []
    for name in FORMATS:
        for rnd in ("rne", "rtz"):
            t = cast_thresholds(name, rnd)
            for v in (t.overflow_at, t.underflow_at, get_format(name).max):
                if np.isfinite(v):
                    for j in range(-12, 13):
                        w = np.float32(v * 2.0**j)
                        extra += [w, np.nextafter(w, np.float32(0)), np.nextafter(w, np.float32(np.inf))]
    extra = np.array(extra, dtype=np.float64)
    x = np.concatenate([x, extra, -extra, [0.0, -0.0, np.nan, np.inf, -np.inf, 1e-45, 3e38]])
    return rng.permutation(x).astype(np.float32)


@pytest.fixture(scope="module")
def data():
    x = planted(np.random.default_rng(1))
    return x, abs_histogram(x)


def test_reference_agrees_with_ml_dtypes(data):
    x, _ = data
    fin = x[np.isfinite(x)]
    for name, dt in ML.items():
        q_ml = np.abs(fin.astype(dt).astype(np.float64))
        q = ref_round(fin, name)
        ok = np.isfinite(q_ml) & (q <= get_format(name).max)
        np.testing.assert_array_equal(q[ok], q_ml[ok], err_msg=name)
        assert np.array_equal(~ok, q > get_format(name).max), name  # overflow = inf/NaN in ml_dtypes


@pytest.mark.parametrize("fmt", FORMATS)
def test_pow2_counts_are_exact(data, fmt):
    x, h = data
    for rounding in ("rne", "rna", "rtz"):
        for j in range(-12, 13):
            want = ref_counts(x, 2.0**j, fmt, rounding)
            got = (h.overflow(fmt, j, rounding), h.underflow(fmt, j, rounding))
            assert got == want, (fmt, rounding, j)


def test_pow2_counts_match_fp8sim_quantize(data):
    fp8sim = pytest.importorskip("fp8sim")
    if not hasattr(fp8sim, "quantize"):
        pytest.skip("fp8sim.quantize not available yet")
    x, h = data
    fin = x[np.isfinite(x)]
    for fmt in ("e4m3", "e5m2", "e3m4", "e4m3fnuz"):
        for j in (-8, -3, 0, 5, 11):
            with np.errstate(over="ignore"):
                p = fin * np.float32(2.0**j)
            q = fp8sim.quantize(p, fmt, saturate=False)
            assert h.overflow(fmt, j) == int((~np.isfinite(q)).sum()), (fmt, j)
            assert h.underflow(fmt, j) == int(((fin != 0) & (q == 0)).sum()), (fmt, j)


def test_histogram_matches_numpy_reference(data):
    x, h = data
    a = np.abs(x[np.isfinite(x) & (x != 0)]).astype(np.float64)
    mant, ex = np.frexp(a)
    f = (2 * mant - 1) * 32
    m = np.floor(f).astype(np.int64)
    ids = (ex - 1 + 150) * 64 + 2 * m + (f != m)
    u, c = np.unique(ids, return_counts=True)
    np.testing.assert_array_equal(h.bins, u)
    np.testing.assert_array_equal(h.counts, c)
    assert (h.zero, h.nan, h.inf) == (int((x == 0).sum()), 1, 2)
    e, cnt = h.binades()
    assert cnt.sum() == a.size
    np.testing.assert_array_equal(cnt, np.bincount(ex - 1 - e.min())[np.unique(ex - 1) - e.min()])
    assert h.max_value() >= a.max()


def test_bounds_bracket_truth_for_any_scale(data):
    x, h = data
    rng = np.random.default_rng(2)
    for fmt in ("e4m3", "e5m2"):
        for s in np.exp2(rng.uniform(-10, 10, 20)):
            ov, un = ref_counts(x, s, fmt)
            lo, hi = h.overflow_bounds(fmt, s)
            assert lo <= ov <= hi
            lo, hi = h.underflow_bounds(fmt, s)
            assert lo <= un <= hi
    assert h.overflow_bounds("e4m3", 4.0) == (h.overflow("e4m3", 2),) * 2


def test_thresholds_hand_values():
    # OCP: e4m3 values <= 464 round to 448 (tie to even), e5m2 values >= 61440 overflow
    t = cast_thresholds("e4m3")
    assert (t.overflow_at, t.overflow_tie, t.underflow_at, t.underflow_tie) == (464, False, 2**-10, True)
    t = cast_thresholds("e5m2")
    assert (t.overflow_at, t.overflow_tie, t.underflow_at) == (61440, True, 2**-17)
    with pytest.raises(ValueError, match="rounding"):
        cast_thresholds("e4m3", "stochastic")
    with pytest.raises(ValueError, match="mantissa bits"):
        abs_histogram(np.ones(3, np.float32), mantissa_bits=2).overflow("e4m3", 0)


def test_float64_torch_and_bf16_inputs():
    rng = np.random.default_rng(3)
    x = rng.standard_normal(5000) * 100
    h64 = abs_histogram(x)
    h32 = abs_histogram(x.astype(np.float32))
    np.testing.assert_array_equal(h64.bins, h32.bins)  # the histogram is of float32(|x|)
    t = torch.from_numpy(x).to(torch.bfloat16)
    hb = abs_histogram(t)
    ref = abs_histogram(t.float().numpy())
    np.testing.assert_array_equal(hb.counts, ref.counts)
    hb2 = abs_histogram(t.float().numpy().astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(hb2.bins, ref.bins)
    with pytest.raises(TypeError, match="expected float16, bfloat16, float32 or float64"):
        abs_histogram(np.arange(4))
    tiny = abs_histogram(np.array([1e-300, 1e300, 1.0]))  # outside float32: sentinel binades
    assert tiny.underflow("e4m3", 0) == 1 and tiny.overflow("e4m3", 0) == 1


def _write(path, steps=7, chunk_steps=3, close=True):
    rng = np.random.default_rng(4)
    tw = TraceWriter(path, {"model": "toy", "lr": 1e-3}, chunk_steps=chunk_steps)
    tw.add_tensor("w", "weight", "e4m3", (8, 16))
    tw.add_tensor("g", "weight_grad", "e5m2", (8, 16))
    data = {}
    for s in range(steps):
        w = (rng.standard_normal((8, 16)) * 3).astype(np.float32)
        g = torch.from_numpy(rng.standard_normal((8, 16)) * 1e-4).to(torch.bfloat16)
        data[s] = (w, g)
        tw.record(s, "w", w, scale=float(448 / np.abs(w).max()))
        tw.record(s, "g", g, scale=2.0**9, amax=1.5)
        if s == 2:
            tw.save_tensor(s, "g", g)
    if close:
        tw.close()
    return tw, data


def test_round_trip(tmp_path):
    _, data = _write(tmp_path / "t")
    assert is_trace(tmp_path / "t") and not is_trace(tmp_path)
    r = TraceReader(tmp_path / "t")
    assert r.config == {"model": "toy", "lr": 1e-3}
    assert [(t.name, t.role, t.format, t.shape) for t in r.tensors] == [
        ("w", "weight", "e4m3", (8, 16)),
        ("g", "weight_grad", "e5m2", (8, 16)),
    ]
    assert len(r.chunk_files) == 3  # steps 0-2, 3-5, 6
    np.testing.assert_array_equal(r.steps(), np.arange(7))
    sc = r.scalars("g")
    np.testing.assert_array_equal(sc["step"], np.arange(7))
    assert np.all(sc["amax"] == 1.5) and np.all(sc["scale"] == 512.0)
    for rec in r.records("w"):
        w = data[rec.step][0]
        assert rec.amax == np.abs(w).max() and rec.numel == 128
        assert rec.scale == float(np.float32(448 / np.abs(w).max()))
        ov, un = ref_counts(w.ravel(), rec.scale, "e4m3")
        assert (rec.overflow, rec.underflow) == (ov, un)
        np.testing.assert_array_equal(rec.hist.counts, abs_histogram(w).counts)
    rec = r.record(4, "g")
    g32 = data[4][1].float().numpy().ravel()
    assert (rec.overflow, rec.underflow) == ref_counts(g32, 512.0, "e5m2")
    assert rec.underflow == rec.hist.underflow("e5m2", 9)
    assert r.saved_tensors() == [(2, "g")]
    t = r.load_tensor(2, "g")
    assert t.dtype == torch.bfloat16 and torch.equal(t, data[2][1])
    with pytest.raises(ValueError, match="no record"):
        r.record(99, "g")


def test_interrupted_writer_loses_only_unflushed_steps(tmp_path):
    tw, _ = _write(tmp_path / "t", steps=8, chunk_steps=3, close=False)
    # steps 0-5 are in chunks (6 and 7 started later); 6, 7 are still buffered
    r = TraceReader(tmp_path / "t")
    np.testing.assert_array_equal(r.steps(), np.arange(6))
    sc = r.scalars()
    assert np.all(np.bincount(sc["step"]) == 2)  # whole steps only
    assert not [f for f in os.listdir(tmp_path / "t" / "chunks") if f.endswith(".tmp")]
    tw.flush()
    r.refresh()
    np.testing.assert_array_equal(r.steps(), np.arange(8))
    with pytest.raises(ValueError, match="already"):
        tw.record(7, "w", np.ones(3, np.float32), scale=1.0)


def test_append_and_errors(tmp_path):
    _write(tmp_path / "t", steps=4)
    with pytest.raises(ValueError, match="already holds a trace"):
        TraceWriter(tmp_path / "t")
    with TraceWriter(tmp_path / "t", {"resumed": True}, mode="a") as tw:
        with pytest.raises(ValueError, match="flushed"):
            tw.record(3, "w", np.ones(4, np.float32), scale=1.0)
        tw.add_tensor("m", "optimizer_state", "e4m3", (4,))
        tw.record(4, "m", np.ones(4, np.float32), scale=1.0)
        tw.record(6, "w", np.ones(4, np.float32), scale=1.0)
        with pytest.raises(ValueError, match="after step"):
            tw.record(5, "w", np.ones(4, np.float32), scale=1.0)
        with pytest.raises(ValueError, match="add_tensor"):
            tw.record(5, "nope", np.ones(4, np.float32), scale=1.0)
        with pytest.raises(ValueError, match="role"):
            tw.add_tensor("q", "bias", "e4m3", (1,))
    r = TraceReader(tmp_path / "t")
    np.testing.assert_array_equal(r.steps(), [0, 1, 2, 3, 4, 6])
    assert r.meta["resumes"] == [{"resumed": True}]
    # a corrupt chunk is named
    bad = r.chunk_files[0]
    bad.write_bytes(bad.read_bytes()[:40])
    with pytest.raises(ValueError, match=bad.name):
        TraceReader(tmp_path / "t").scalars()
    (tmp_path / "t" / "trace.json").write_text(json.dumps({"schema": "other"}))
    with pytest.raises(ValueError, match="not an fp8sim trace"):
        TraceReader(tmp_path / "t")


def test_histogram_object_checks():
    with pytest.raises(ValueError):
        AbsHistogram(np.zeros(2, np.uint32), np.zeros(3, np.int64), 5)
    h = abs_histogram(np.array([0.0, 1.0, 2.0, np.nan], np.float32))
    assert (h.numel, h.nonzero, h.zero, h.nan) == (4, 2, 1, 1)


def test_recorded_counts_match_quantize_scaled_for_float64(tmp_path):
    scaling = pytest.importorskip("fp8sim.scaling")
    rng = np.random.default_rng(5)
    x = rng.standard_normal(3000) * np.exp2(rng.integers(-25, 12, 3000))
    scale = 37.3
    with TraceWriter(tmp_path / "t") as tw:
        tw.add_tensor("a", "activation", "e4m3", x.shape)
        tw.record(0, "a", x, scale=scale)
    rec = TraceReader(tmp_path / "t").record(0, "a")
    st = scaling.quantize_scaled(x, "e4m3", scale=np.float32(scale), saturate=True)
    q = np.abs(st.dequantize())
    assert rec.underflow == int(((x != 0) & (q == 0)).sum())
    # saturating cast: overflowed values land on max; the reference rounding separates them
    assert (rec.overflow, rec.underflow) == ref_counts(x.astype(np.float32), scale, "e4m3")
    assert rec.overflow == int((np.abs(x.astype(np.float32) * np.float32(scale)) > 464).sum())


def test_count_scaled_above(data):
    x, h = data
    a = np.abs(x[np.isfinite(x) & (x != 0)]).astype(np.float64)
    rng = np.random.default_rng(6)
    for t in (432.0, 464.0, 2.0**-10, 57344.0, 1.0):
        for j in range(-6, 7, 3):
            for inclusive in (False, True):
                s = 2.0**j
                p = a * s  # exact: power-of-two scale
                want = int(((p >= t) if inclusive else (p > t)).sum())
                assert h.count_scaled_above(t, s, inclusive=inclusive) == (want, want)
        for s in np.exp2(rng.uniform(-6, 6, 5)):
            with np.errstate(over="ignore"):  # float32 products past its max are inf, as counted
                p = (a.astype(np.float32) * np.float32(s)).astype(np.float64)
            lo, hi = h.count_scaled_above(t, s)
            assert lo <= int((p > t).sum()) <= hi


def test_corrupt_trace_json_and_chunk_columns_raise_valueerror(tmp_path):
    _write(tmp_path / "t", steps=3, chunk_steps=3)
    meta_path = tmp_path / "t" / "trace.json"
    meta = json.loads(meta_path.read_text())
    bad = dict(meta)
    del bad["hist"]
    meta_path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="trace.json"):
        TraceReader(tmp_path / "t")
    bad = json.loads(json.dumps(meta))
    del bad["tensors"][0]["role"]
    meta_path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="trace.json"):
        TraceReader(tmp_path / "t")
    meta_path.write_text(json.dumps(meta))
    (chunk,) = TraceReader(tmp_path / "t").chunk_files
    with np.load(chunk) as z:
        good = {k: z[k] for k in z.files}
    for col, fix in (("tensor", -1), ("format", 7), ("hist_offsets", None)):
        cols = {k: v.copy() for k, v in good.items()}
        if fix is None:
            cols[col][1] = cols[col][-1] + 5  # beyond the bins, then decreasing
        else:
            cols[col][0] = fix
        with open(chunk, "wb") as f:
            np.savez(f, **cols)
        with pytest.raises(ValueError, match="corrupt trace chunk"):
            list(TraceReader(tmp_path / "t").records())


def _write_steps(tw: TraceWriter, steps, names=("a", "b")) -> None:
    for s in steps:
        for i, n in enumerate(names):
            x = np.random.default_rng(100 * s + i).standard_normal(64).astype(np.float32) * (s + 1)
            tw.record(s, n, x, scale=1.0)
            if s % 2 == 0:
                tw.save_tensor(s, n, x)


def test_truncate_after_drops_later_steps_and_appends_again(tmp_path):
    """A resumed run cuts the trace back to its checkpoint step and records the later steps
    again: the result equals a trace written in one go (chunks cut through the middle too)."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    for d in (full, cut):
        with TraceWriter(d, chunk_steps=3) as tw:
            for n in ("a", "b"):
                tw.add_tensor(n, "activation", "e4m3", (64,))
            _write_steps(tw, range(1, 8) if d == full else range(1, 7))  # "cut" was killed after step 6
    tw = TraceWriter(cut, mode="a")
    tw.truncate_after(4)  # the checkpoint: step 4 (chunk 4..6 straddles it)
    r = TraceReader(cut)
    assert sorted(set(r.steps().tolist())) == [1, 2, 3, 4]
    assert max(s for s, _ in r.saved_tensors()) == 4
    with pytest.raises(ValueError, match="already flushed"):
        tw.record(4, "a", np.ones(64, np.float32), scale=1.0)
    _write_steps(tw, range(5, 8))
    tw.close()
    a, b = TraceReader(full), TraceReader(cut)
    sa, sb = a.scalars(), b.scalars()
    assert set(sa) == set(sb) and all(np.array_equal(sa[k], sb[k]) for k in sa)
    assert a.saved_tensors() == b.saved_tensors()
    for step in range(1, 8):
        for n in ("a", "b"):
            ha, hb = a.histogram(step, n), b.histogram(step, n)
            assert np.array_equal(ha.bins, hb.bins) and np.array_equal(ha.counts, hb.counts)


def test_interrupted_truncation_leaves_no_duplicate_steps(tmp_path):
    """A truncation killed between writing the shortened chunk and removing the old one leaves
    both files of one sequence number: readers take the shorter, the next truncation removes
    the other."""
    import shutil

    from fp8sim.trace import truncate_trace

    t = tmp_path / "t"
    with TraceWriter(t, chunk_steps=3) as tw:
        for n in ("a", "b"):
            tw.add_tensor(n, "activation", "e4m3", (64,))
        _write_steps(tw, range(1, 7))  # chunks 1..3 and 4..6
    old = sorted((t / "chunks").iterdir())[-1]
    keep = tmp_path / "old.npz"
    shutil.copy(old, keep)
    truncate_trace(t, 4)
    shutil.copy(keep, old)  # as if the old chunk had not been removed yet
    assert len(list((t / "chunks").iterdir())) == 3
    r = TraceReader(t)
    assert r.steps().tolist() == [1, 2, 3, 4] and r.scalars()["step"].size == 8  # 2 tensors x 4 steps
    truncate_trace(t, 4)
    assert len(list((t / "chunks").iterdir())) == 2 and not old.exists()
    r = TraceReader(t)
    assert r.steps().tolist() == [1, 2, 3, 4] and r.scalars()["step"].size == 8


@pytest.mark.parametrize("kw, what", [
    ({"scale": float("inf")}, "scale"), ({"scale": 0.0}, "scale"), ({"scale": 1e39}, "scale"),
    ({"scale": 1e-50}, "scale"), ({"scale": float("nan")}, "scale"),
    ({"scale": 1.0, "amax": -1.0}, "amax"),
])  # fmt: skip
def test_record_refuses_what_replay_cannot_use(tmp_path, kw, what):
    with TraceWriter(tmp_path / "t", {}) as tw:
        tw.add_tensor("w", "weight", "e4m3", (4,))
        with pytest.raises(ValueError, match=what):
            tw.record(0, "w", np.ones(4, np.float32), **kw)
        tw.record(0, "w", np.ones(4, np.float32), scale=1.0, amax=float("nan"))  # NaN/inf: kept
        tw.record(1, "w", np.ones(4, np.float32), scale=1.0, amax=float("inf"))

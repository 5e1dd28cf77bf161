"""fp8sim.analysis.stats: every figure equals what fp8sim.scaling.quantize_scaled + dequantize (and
fp8sim.decode) give on the whole tensor; counts exactly, float sums to float64 rounding."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

import fp8sim
from fp8sim.analysis.stats import LOG2_EXPONENTS, Variant, parse_variants, tensor_stats
from fp8sim.scaling import compute_amax, dequantize, quantize_scaled, scale_from_amax

SCALINGS = ["none", "tensor", "row", "col", "block:16x16", "block:1x128", "mx", "mx:rceil"]


def reference(x, fmt, scaling):
    """Figures of one variant straight from the emulator on the whole tensor."""
    fmt = fp8sim.get_format(fmt)
    x64 = np.asarray(x, dtype=np.float64)
    g = "tensor" if scaling == "none" else scaling
    kw = {"scale": np.float32(1)} if scaling == "none" else {}
    st = quantize_scaled(x, fmt, g, saturate=True, **kw)
    deq = dequantize(st).astype(np.float64)
    fin = np.isfinite(x64)
    lost = fin & np.isnan(deq)  # MX blocks with a NaN scale
    ok = fin & ~lost
    dec = np.abs(fp8sim.decode(st.codes, fmt, dtype=np.float64))
    out = {
        "underflow": int((ok & (x64 != 0) & (dec == 0)).sum()),
        "subnormal": int((ok & (dec > 0) & (dec < fmt.min_normal)).sum()),
        "lost": int(lost.sum()),
        "err2": math.fsum(((deq[ok] - x64[ok]) ** 2).tolist()),
        "sig2": math.fsum((x64[ok] ** 2).tolist()),  # the values compared: lost ones left out
    }
    if fmt.has_nan:  # non-saturating: overflow shows as inf/NaN
        ns = dequantize(quantize_scaled(x, fmt, g, saturate=False, **kw)).astype(np.float64)
        out["overflow"] = int((ok & ~np.isfinite(ns)).sum())
    if scaling == "none":
        mult = np.float32(1)
    elif scaling.startswith("mx"):
        mult = np.float32(1) / np.asarray(st.scale_inv, np.float32)  # powers of two: exact
    else:
        mult = scale_from_amax(compute_amax(x, g, ignore_nan=True), fmt)
    mult = np.asarray(mult)
    out["scale"] = float(np.nanmin(mult)) if np.isfinite(mult).any() else math.nan
    return out


def mixed(rng, shape, dtype=np.float32):
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-24, 12, shape))
    x = x.astype(dtype)
    flat = x.reshape(-1)
    flat[rng.integers(0, flat.size, 5)] = 0
    return x


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e3m4", "e4m3fnuz", "e2m1"])
def test_figures_equal_the_emulator(fmt):
    rng = np.random.default_rng(7)
    x = mixed(rng, (130, 150))
    x[3, 5], x[7, 9], x[100, 140] = np.nan, np.inf, -np.inf
    x[10, :] = 0
    x[20, 3] = 1e4  # overflows unscaled e4m3/e3m4/e2m1
    if fmt == "e2m1":  # no NaN encoding: the emulator refuses NaN inputs
        x[3, 5] = 1.0
    vs = parse_variants([fmt], SCALINGS)
    st = tensor_stats(x, vs, chunk=4321)  # chunks that cut rows and blocks
    x64 = x.astype(np.float64)
    fin = np.isfinite(x64)
    assert (st.nan, st.inf, st.zero) == (int(np.isnan(x).sum()), 2, int((x == 0).sum()))
    assert st.amax == float(np.abs(x[fin]).max())
    assert st.sig2 == pytest.approx(math.fsum((x64[fin] ** 2).tolist()), rel=1e-12, abs=0)
    for v, r in zip(vs, st.variants):
        ref = reference(x, fmt, v.scaling)
        what = (fmt, v.scaling)
        assert (r.underflow, r.subnormal, r.lost) == (ref["underflow"], ref["subnormal"], ref["lost"]), what
        if "overflow" in ref:
            assert r.overflow == ref["overflow"], what
        assert r.err2 == pytest.approx(ref["err2"], rel=1e-12, abs=0), what
        sig2 = ref["sig2"]
        assert (sig2 < st.sig2) == (r.lost > 0), what
        assert r.sqnr_db == pytest.approx(10 * math.log10(sig2 / ref["err2"]), rel=1e-12, abs=0), what
        assert r.rel_mse == pytest.approx(ref["err2"] / sig2, rel=1e-12, abs=0), what
        assert r.scale == ref["scale"] or (math.isnan(r.scale) and math.isnan(ref["scale"])), what


def test_overflow_counts_against_ml_dtypes():
    # unscaled casts: ml_dtypes rounds RNE and overflows to inf/NaN (an independent library)
    rng = np.random.default_rng(8)
    x = mixed(rng, (64, 100)) * 1e3
    vs = parse_variants(["e4m3", "e5m2"], ["none"])
    st = tensor_stats(x, vs)
    for r, dt in zip(st.variants, (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)):
        q = x.astype(dt).astype(np.float64)
        assert r.overflow == int((~np.isfinite(q)).sum()) > 0
        assert r.underflow == int(((x != 0) & (q == 0)).sum()) > 0


def test_dtypes_float64_bf16_torch():
    rng = np.random.default_rng(9)
    x64 = mixed(rng, (40, 70), np.float64)
    x64[0, 0] = 1e-60  # below float32: becomes 0 in the scaled cast (underflow)
    x64[0, 1] = 1e40  # beyond float32: inf in float32 (overflow of any scale)
    vs = parse_variants(["e4m3"], ["none", "row"])
    st = tensor_stats(x64, vs, chunk=999)
    assert st.dtype == "float64"
    for v, r in zip(vs, st.variants):
        ref = reference(x64, "e4m3", v.scaling)
        assert (r.underflow, r.subnormal, r.overflow) == (ref["underflow"], ref["subnormal"], ref["overflow"])
        assert r.err2 == pytest.approx(ref["err2"], rel=1e-12, abs=0)
    assert st.log2_counts[0] == 1 and st.log2_counts[-1] == 1  # the sentinel binades

    xb = torch.from_numpy(mixed(rng, (33, 65))).to(torch.bfloat16)
    st_t = tensor_stats(xb, vs)
    xf = xb.float().numpy()
    st_f = tensor_stats(xf, vs)
    assert st_t.dtype == "bfloat16"
    for a, b in zip(st_t.variants, st_f.variants):
        assert (a.overflow, a.underflow, a.subnormal, a.err2) == (b.overflow, b.underflow, b.subnormal, b.err2)
    st_m = tensor_stats(xf.astype(ml_dtypes.bfloat16), vs)
    assert st_m.variants[1].err2 == st_f.variants[1].err2
    with pytest.raises(TypeError):
        tensor_stats(np.arange(10), vs)


def test_log2_histogram_and_empty():
    x = np.array([0.75, 1.0, 1.5, -3.0, 2.0**-140, 0.0, np.nan], np.float32)
    st = tensor_stats(x, parse_variants(["e4m3"], ["tensor"]))
    got = dict(zip(LOG2_EXPONENTS[st.log2_counts > 0].tolist(), st.log2_counts[st.log2_counts > 0].tolist()))
    assert got == {-1: 1, 0: 2, 1: 1, -140: 1}  # floor(log2|x|), a float32 subnormal included
    e = tensor_stats(np.zeros((0, 4), np.float32), parse_variants(["e4m3"], ["tensor"]))
    assert e.numel == 0 and e.variants == []


def test_records_and_variants_parsing():
    x = np.linspace(-2, 2, 101, dtype=np.float32)
    st = tensor_stats(x, parse_variants(["e4m3", "e5m2"], ["tensor", "block:1x32"]), name="t")
    recs = st.records()
    assert [(r["format"], r["scaling"]) for r in recs] == [
        ("e4m3", "tensor"), ("e4m3", "block:1x32"), ("e5m2", "tensor"), ("e5m2", "block:1x32")
    ]
    need = {"name", "shape", "dtype", "numel", "format", "scaling", "amax", "scale", "overflow",
            "underflow", "subnormal", "nan", "inf", "sqnr_db", "rel_mse"}
    assert need <= set(recs[0])
    assert recs[0]["scale"] == pytest.approx(448 / 2, rel=1e-7) and recs[0]["amax"] == 2.0
    with pytest.raises(ValueError, match="e8m0"):
        parse_variants(["e8m0"], ["tensor"])
    with pytest.raises(ValueError):
        parse_variants(["e4m3"], ["diagonal"])
    with pytest.raises(ValueError, match="mx"):
        parse_variants(["e4m3"], ["mx"], margin=1)


def test_sqnr_of_huge_float64_values_stays_defined():
    # x^2 overflows float64 beyond ~1.3e154; e4m3 without scaling saturates them to +-448
    x = np.array([1e200, -3e180, 2.0, 0.5, 7e160], np.float64)
    st = tensor_stats(x, parse_variants(["e4m3"], ["none"]))
    (r,) = st.variants
    deq = np.array([448.0, -448.0, 2.0, 0.5, 448.0])  # hand values (saturating cast)
    a = 1e200  # scaled reference sums stay finite
    sig = math.fsum(((x / a) ** 2).tolist())
    err = math.fsum((((deq - x) / a) ** 2).tolist())
    assert r.sqnr_db == pytest.approx(10 * math.log10(sig / err), rel=1e-9, abs=1e-9)
    assert r.rel_mse == pytest.approx(err / sig, rel=1e-9, abs=0)
    rec = st.records()[0]
    assert rec["sqnr_db"] is not None and rec["rel_mse"] is not None


def test_table_never_shows_exact_for_an_undefined_sqnr():
    from fp8sim.analysis.report import format_table

    base = {"status": "ok", "name": "t", "format": "e4m3", "scaling": "none", "numel": 4,
            "amax": 1.0, "scale": 1.0, "overflow": 0, "overflow_pct": 0.0, "underflow": 0,
            "underflow_pct": 0.0, "subnormal": 0, "subnormal_pct": 0.0}  # fmt: skip
    undefined = format_table([{**base, "sqnr_db": None, "rel_mse": None,
                                "sqnr_case": "undefined"}]).splitlines()[-1]  # fmt: skip
    exact = format_table([{**base, "sqnr_db": None, "rel_mse": 0.0,
                           "sqnr_case": "exact"}]).splitlines()[-1]  # fmt: skip
    assert not undefined.endswith("exact") and exact.endswith("exact")


def _awkward_float32(rng, n):
    """Values spread over float32's whole range: zeros, subnormals, NaN, +-inf, huge values that
    overflow every format unscaled, scattered so that some blocks and parts hold them and most
    do not."""
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-40, 30, n))).astype(np.float32)
    for value, count in ((0.0, 300), (np.nan, 7), (np.inf, 3), (-np.inf, 2), (3e38, 2)):
        x[rng.integers(0, n, count)] = value
    x[rng.integers(0, n, 50)] = np.float32(2.0**-140) * rng.integers(1, 1000, 50)  # subnormals
    return x


def _figures(st):
    return (
        (st.nan, st.inf, st.zero, st.amax, st.sig2, st.log2_counts.tolist()),
        [(v.overflow, v.underflow, v.subnormal, v.lost, v.err2, v.scale) for v in st.variants],
    )


def test_float32_kernels_equal_the_general_kernels_bit_for_bit():
    # float32 input takes the 32-bit kernels (the error in float32, a block with an overflow,
    # NaN or inf redone); the same values as float64 take the general float64 kernels. Same
    # figures, sums included, to the last bit.
    rng = np.random.default_rng(11)
    x = _awkward_float32(rng, 300_000).reshape(600, 500)  # several parts and thread chunks
    x[5] = rng.standard_normal(500) * 2e37  # near bf16's max: bf16 takes the general kernel
    vs = parse_variants(["e4m3", "e5m2", "e2m1", "bf16"], ["none", "tensor", "row", "block:1x128", "mx"])
    a = tensor_stats(x, vs)
    b = tensor_stats(x.astype(np.float64), vs)
    assert _figures(a) == _figures(b)
    assert a.variants[0].overflow > 0 and a.variants[0].underflow > 0 and a.variants[0].subnormal > 0


def test_large_float32_figures_equal_the_emulator():
    # more than one part per chunk (threads), blocks with and without NaN/inf/zeros/subnormals
    rng = np.random.default_rng(12)
    x = _awkward_float32(rng, 200_000)
    x[:500] = rng.standard_normal(500) * 2e37  # near bf16's max
    vs = parse_variants(["e4m3", "e5m2", "bf16"], ["none", "tensor"])
    st = tensor_stats(x, vs, chunk=150_000)
    x64 = x.astype(np.float64)
    fin = np.isfinite(x64)
    assert (st.inf, st.zero) == (int(np.isinf(x).sum()), int((x == 0).sum()))
    assert st.sig2 == pytest.approx(math.fsum((x64[fin] ** 2).tolist()), rel=1e-12, abs=0)
    for v, r in zip(vs, st.variants):
        ref = reference(x, v.fmt.name, v.scaling)
        assert (r.overflow, r.underflow, r.subnormal) == (ref["overflow"], ref["underflow"], ref["subnormal"])
        assert r.err2 == pytest.approx(ref["err2"], rel=1e-12, abs=0)


def test_log2_histogram_of_awkward_values_matches_numpy():
    rng = np.random.default_rng(13)
    x = _awkward_float32(rng, 150_000)
    st = tensor_stats(x, parse_variants(["e4m3"], ["none"]), chunk=70_000)
    a = np.abs(x[np.isfinite(x) & (x != 0)]).astype(np.float64)
    _, e = np.frexp(a)  # a = m * 2**e, 0.5 <= m < 1: floor(log2 a) = e - 1, subnormals too
    want = np.bincount(e - 1 - LOG2_EXPONENTS[0], minlength=LOG2_EXPONENTS.size)
    assert st.log2_counts.tolist() == want.tolist()
    assert st.nan == int(np.isnan(x).sum()) and st.inf == int(np.isinf(x).sum())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pass_a_and_pass_b_give_the_same_format_independent_figures(dtype):
    # with a just-in-time scaling pass A takes NaN/inf/zero, amax, sum x^2 and the histogram;
    # with "none" only pass B does: the same parts and blocks, so the same figures to the last
    # bit, and the histogram is numpy's either way
    rng = np.random.default_rng(16)
    x = _awkward_float32(rng, 333_333).astype(dtype)
    if dtype == np.float64:
        x[rng.integers(0, x.size, 5)] = 1e300  # beyond float32: the top sentinel bin
    fig = []
    for scaling in ("none", "tensor", "block:1x32"):
        st = tensor_stats(x, parse_variants(["e4m3"], [scaling]), chunk=150_000)
        fig.append(_figures(st)[0])
    assert fig[0] == fig[1] == fig[2]
    with np.errstate(over="ignore"):  # float64 beyond float32 becomes inf: the top bin
        a = np.abs(x[np.isfinite(x) & (x != 0)]).astype(np.float32).astype(np.float64)
    _, e = np.frexp(a[np.isfinite(a)])
    want = np.bincount(e - 1 - LOG2_EXPONENTS[0], minlength=LOG2_EXPONENTS.size)
    want[-1] += int(np.isinf(a).sum())
    assert fig[1][5] == want.tolist()


def test_figures_do_not_depend_on_the_thread_count():
    import numba

    rng = np.random.default_rng(14)
    x = _awkward_float32(rng, 400_000)
    vs = parse_variants(["e4m3", "e5m2"], ["tensor", "block:1x32"])
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = tensor_stats(x, vs)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        many = tensor_stats(x, vs)
    finally:
        numba.set_num_threads(before)
    assert _figures(one) == _figures(many)


def test_dequantized_overflow_gives_infinite_error_not_a_crash():
    # scale_inv near float32's max: max * scale_inv overflows float32, deq is inf (as dequantize
    # gives it), so the error is infinite; no value rounds above the format's max
    cases = [(np.array([3.4e38, 1.0], np.float32), "e4m3", "mx:rceil"),
             (np.array([3.4028235e38, 3.3995004e38, 1.0], np.float32), "e3m4", "tensor")]  # fmt: skip
    for x, fmt, scaling in cases:
        for dt in (np.float32, np.float64):
            (v,) = tensor_stats(x.astype(dt), parse_variants([fmt], [scaling])).variants
            assert v.overflow == 0 and v.err2 == math.inf
            assert v.sqnr_db == -math.inf and v.rel_mse == math.inf
        st = tensor_stats(x, parse_variants([fmt], [scaling]))
        deq = dequantize(quantize_scaled(x, fmt, scaling, saturate=True))
        assert np.isinf(deq).any()
        assert st.records()[0]["sqnr_db"] is None


def test_a_scale_that_underflowed_to_zero_gives_an_infinite_error():
    # margin 126 and a huge amax: 448 * 2**-126 / 3e38 underflows to a scale of 0 (pow2 keeps
    # it 0); scale_inv is inf and 0 x inf NaN, as dequantize gives it -- an undefined error,
    # reported as the worst (never as "no finite value")
    x = np.array([3e38, 1.0, -2.0, 0.0], np.float32)
    for pow2 in (False, True):
        (v,) = tensor_stats(x, [Variant(fp8sim.get_format("e4m3"), "tensor", 126.0, pow2)]).variants
        assert v.scale == 0.0 and v.underflow == 3 and v.overflow == 0
        assert v.sqnr_db == -math.inf and v.rel_mse == math.inf
        deq = dequantize(quantize_scaled(x, "e4m3", "tensor", margin=126, pow2=pow2, saturate=True))
        assert not np.isfinite(deq).any()


def test_column_tiles_sum_their_errors_pairwise():
    # col scaling casts one element per row at a time; the block's squared errors are still
    # summed as one pairwise sum, not one by one (hand check against math.fsum)
    rng = np.random.default_rng(0)
    x = (rng.integers(-(2**23), 2**23, 2048 * 64).astype(np.float32) * np.float32(2.0**-149))
    x = x.reshape(2048, 64)
    x[rng.integers(0, 2048, 500), rng.integers(0, 64, 500)] = 0
    for fmt in ("e2m1", "e4m3"):
        (v,) = tensor_stats(x, parse_variants([fmt], ["col"]), chunk=99_999).variants
        deq = dequantize(quantize_scaled(x, fmt, "col")).astype(np.float64)
        exact = math.fsum(((deq - x.astype(np.float64)) ** 2).ravel().tolist())
        assert v.err2 == pytest.approx(exact, rel=1e-14, abs=0)


def test_values_lost_to_a_nan_mx_scale_leave_both_sums():
    # hand computation: block 0 holds a NaN (its 31 finite values are lost), block 1 is 31 ones
    # and float32(1.1); e4m3 MX (floor): scale 2**-8, 1.1 * 256 = 281.6 rounds to 288 (quantum
    # 32), so deq 1.125; the SQNR compares block 1 only: 10 log10((31 + 1.1^2) / (1.125 - 1.1)^2)
    x = np.r_[np.full(32, 100.0), np.full(32, 1.0)].astype(np.float32)
    x[0], x[40] = np.nan, 1.1
    (v,) = tensor_stats(x, parse_variants(["e4m3"], ["mx"])).variants
    a = float(np.float32(1.1))
    assert v.lost == 31 and v.err2 == (1.125 - a) ** 2
    assert v.sqnr_db == pytest.approx(10 * math.log10((31 + a * a) / (1.125 - a) ** 2), rel=1e-14)
    # chunks with and without lost blocks, rows that cut blocks: the emulator, lost values out
    rng = np.random.default_rng(5)
    x = mixed(rng, (37, 300))
    x[rng.integers(0, 37, 6), rng.integers(0, 300, 6)] = np.nan
    x[2, 7], x[30, 299] = np.inf, -np.inf
    for scaling in ("mx", "mx:rceil"):
        for chunk in (1000, 4321, None):
            (r,) = tensor_stats(x, parse_variants(["e5m2"], [scaling]), chunk=chunk).variants
            ref = reference(x, "e5m2", scaling)
            assert r.lost == ref["lost"] > 0
            assert r.rel_mse == pytest.approx(ref["err2"] / ref["sig2"], rel=1e-12, abs=0)
    # every finite value lost: nothing compared, the SQNR is undefined (not exact)
    (v,) = tensor_stats(np.array([np.nan, 1.0, 2.0], np.float32), parse_variants(["e4m3"], ["mx"])).variants
    assert v.lost == 2 and math.isnan(v.sqnr_db) and math.isnan(v.rel_mse)


def test_zeros_in_lost_mx_blocks_are_neither_underflow_nor_subnormal():
    # the kernels count zeros with the values that round to 0 and take the tensor's zeros off at
    # the end; zeros in an MX block with a NaN scale are lost, not counted there: off they stay
    rng = np.random.default_rng(21)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    x[0, 0] = np.nan  # the first block of 32 gets a NaN scale
    x[0, 1:6] = 0.0
    x[1, [3, 40]] = 0.0
    x[1, 50] = 1e-30  # a true underflow
    ref = reference(x, "e4m3", "mx")
    for dt in (np.float32, np.float64):
        (v,) = tensor_stats(x.astype(dt), parse_variants(["e4m3"], ["mx"])).variants
        assert (v.underflow, v.subnormal, v.lost) == (ref["underflow"], ref["subnormal"], ref["lost"])
        assert v.lost == 31 and v.underflow >= 1


def test_group_range_holds_every_touched_group_and_no_whole_long_row():
    # brute force over small shapes, tiles and chunks: every group a chunk touches lies in the
    # range; along rows (r == 1, or a chunk inside one row) the range is exactly those groups
    from fp8sim.analysis.stats.figures import _group_range

    for m, n in [(1, 37), (3, 10), (7, 5), (4, 64)]:
        for r, c in [(1, 1), (1, 4), (2, 3), (3, 8), (m, n), (1, n)]:
            gc = -(-n // c)
            for start in range(m * n):
                for size in (1, 2, 5, 11, m * n):
                    size = min(size, m * n - start)
                    idx = np.arange(start, start + size)
                    groups = (idx // n // r) * gc + (idx % n) // c
                    lo, hi = _group_range(start, size, n, r, c, gc)
                    assert lo <= groups.min() and groups.max() <= hi, (m, n, r, c, start, size)
                    if r == 1 or start // n == (start + size - 1) // n:
                        assert (lo, hi) == (groups.min(), groups.max())


def test_long_rows_cut_into_chunks_give_the_whole_tensor_figures():
    # one long row and two: chunks inside a row; MX groups of 32 and 1x128 blocks per chunk
    rng = np.random.default_rng(11)
    for shape in [(1, 70_001), (2, 40_000)]:
        x = mixed(rng, shape)
        vs = parse_variants(["e4m3", "e5m2"], ["mx", "block:1x128", "row", "tensor"])
        whole = tensor_stats(x, vs, chunk=x.size)
        cut = tensor_stats(x, vs, chunk=4321)
        for a, b in zip(whole.variants, cut.variants):
            assert (a.overflow, a.underflow, a.subnormal, a.lost, a.scale, a.scale_max) == (
                b.overflow, b.underflow, b.subnormal, b.lost, b.scale, b.scale_max)
            assert a.err2 == pytest.approx(b.err2, rel=1e-12, abs=0)
        for v, r in zip(vs, cut.variants):
            ref = reference(x, v.fmt.name, v.scaling)
            assert (r.underflow, r.subnormal, r.lost) == (ref["underflow"], ref["subnormal"], ref["lost"])
            assert r.err2 == pytest.approx(ref["err2"], rel=1e-12, abs=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tensor_scaling_figures_do_not_depend_on_the_other_variants(dtype):
    # adding a row variant (tiled amaxes in pass A) leaves the tensor/none variants' figures as
    # they are, to the last bit: the same parts and blocks, the same scales
    rng = np.random.default_rng(21)
    x = _awkward_float32(rng, 300_000).astype(dtype)
    fmt = fp8sim.get_format
    vs = [Variant(fmt("e4m3"), "tensor"), Variant(fmt("e5m2"), "tensor", 1.0, True),
          Variant(fmt("e3m2"), "tensor", -2.0), Variant(fmt("e4m3"), "none")]
    two = tensor_stats(x, vs + [Variant(fmt("e4m3"), "row")])
    one = tensor_stats(x, vs)
    f_one, f_two = _figures(one), _figures(two)
    assert f_one[0] == f_two[0] and f_one[1] == f_two[1][:4]
    # and the scales are the scaling module's: amax from the finite values (an inf among them)
    fin = np.isfinite(x)
    assert one.variants[0].scale == 1.0  # the tensor holds an inf: scale 1
    y = np.where(np.isinf(x), 0, x).astype(dtype)
    one = tensor_stats(y, vs)
    amax = np.float32(np.abs(y[fin]).max())
    assert [v.scale for v in one.variants[:3]] == [
        float(scale_from_amax(amax, v.fmt, margin=v.margin, pow2=v.pow2)) for v in vs[:3]]
    # and the figures are the emulator's on the whole tensor
    for r, scaling in ((one.variants[0], "tensor"), (one.variants[3], "none")):
        ref = reference(y, "e4m3", scaling)
        assert (r.underflow, r.subnormal, r.lost) == (ref["underflow"], ref["subnormal"], 0)
        assert r.overflow == ref["overflow"] and r.scale == ref["scale"]
        assert r.err2 == pytest.approx(ref["err2"], rel=1e-12, abs=0)

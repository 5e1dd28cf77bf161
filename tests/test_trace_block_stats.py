"""Block statistics of block-scaled casts: the scale-code histogram against fp8sim.scaling's own
E8M0 codes and NVFP4's E4M3 codes, clipped values against the analyzer's exact MX counts and the
training path's NVFP4 events, and MX replayed from the block-relative histogram equal to the
analyzer's cast of the full tensor, in every element format."""

import numpy as np
import pytest
import torch

from fp8sim.analysis.stats import parse_variants, tensor_stats
from fp8sim.backends import get as get_backend
from fp8sim.scaling import e8m0_codes
from fp8sim.trace.block_stats import block_statistics, mx_floor_counts

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _wide(rows=37, cols=100, seed=0):
    """Rows spanning many binades, blocks far below the tensor amax, a ragged last block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-30, 12, (rows, 1), generator=g).float())
    x[3, 5:9] = 0.0
    x[4, :32] = 0.0  # an all-zero block
    x[5, 32:64] = 1e-38  # a block whose amax is below 2**-112
    return x


def test_mx_scale_codes_and_clipped_values():
    x = _wide()
    be = get_backend("emulator")
    codes, scale_inv, _ = be.block_quantize(x, "e4m3", "mx")
    st = block_statistics(x, codes, scale_inv, "e4m3", "mx")
    ref = np.bincount(e8m0_codes(scale_inv.numpy()).reshape(-1), minlength=256)
    assert st.kind == "e8m0" and st.blocks == scale_inv.numel()
    np.testing.assert_array_equal(st.codes, np.flatnonzero(ref))
    np.testing.assert_array_equal(st.counts, ref[ref > 0])
    s = scale_inv.double().numpy()
    assert (st.scale_min, st.scale_max) == (s.min(), s.max()) and st.scale_std == pytest.approx(s.std(), rel=1e-12)
    # the analyzer counts the floor rule's clamped values as its overflow
    mx = tensor_stats(x, parse_variants(["e4m3"], ["mx"]))
    assert st.clipped == mx.variants[0].overflow > 0
    # the block of 1e-38s wants a scale below 2**-127: clamped, and outside the exact replay
    assert st.scale_underflow == 1 and st.nan_blocks == 0 and st.rel_unsafe == 1


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e3m4", "e2m3"])
def test_mx_replayed_from_block_statistics_equals_the_full_cast(fmt):
    x = _wide(seed=1)
    x[5, 32:64] = 0.25  # every block within the exact range
    codes, scale_inv, _ = get_backend("emulator").block_quantize(x, "e4m3", "mx")
    st = block_statistics(x, codes, scale_inv, "e4m3", "mx")
    over, under, exact = mx_floor_counts(st, fmt, 5)
    v = tensor_stats(x, parse_variants([fmt], ["mx"])).variants[0]
    assert exact and (over, under) == (v.overflow, v.underflow)
    assert over > 0 or under > 0  # a case with something to count


def test_mx_nan_blocks_are_lost_not_counted():
    x = _wide(seed=2)
    x[0, 3] = float("nan")
    codes, scale_inv, _ = get_backend("emulator").block_quantize(x, "e4m3", "mx")
    st = block_statistics(x, codes, scale_inv, "e4m3", "mx")
    assert st.nan_blocks == 1 and 255 in st.codes.tolist()
    assert st.rel.numel == x.numel() - 32  # the NaN block's 32 values left out


@pytest.mark.parametrize("variant", ["te", "torchao", "torchao-block"])
def test_nvfp4_clipped_and_scale_underflow(variant):
    from fp8sim.training.fp8_state import Fp8Operand, _nvfp4_events

    x = _wide(cols=96, seed=3)
    be = get_backend("emulator")
    codes, block_scale, tensor_scale, global_amax = be.nvfp4_quantize(x, "1x16", variant)
    st = block_statistics(x, codes, block_scale, "e2m1", f"nvfp4:1x16:{variant}", global_amax=float(global_amax))
    from fp8sim.scaling import parse_granularity

    op = Fp8Operand(codes, block_scale, __import__("fp8sim").get_format("e2m1"),
                    parse_granularity(f"nvfp4:1x16:{variant}"), tensor_scale=tensor_scale, global_amax=global_amax)
    over, _ = _nvfp4_events(x, op, codes & 0x7)  # the training path's own count
    assert st.kind == "e4m3" and st.clipped == over
    enc = block_scale.to(torch.float8_e4m3fn).view(torch.uint8).long()
    nonzero = (x.reshape(x.shape[0], -1, 16) != 0).any(-1)
    assert st.scale_underflow == int(((enc == 0) & nonzero).sum())
    assert st.rel is None  # replayed from saved tensors only


def test_block_rxc_float32_scales():
    x = _wide(seed=4)
    codes, scale_inv, _ = get_backend("emulator").block_quantize(x, "e4m3", "block:1x32", pow2=True)
    st = block_statistics(x, codes, scale_inv, "e4m3", "block:1x32", policy_params={"pow2": True})
    assert st.kind == "f32" and st.clipped == 0 and st.scale_underflow == st.scale_saturated == 0
    _, ex = np.frexp(scale_inv.numpy())
    assert sorted(st.codes.tolist()) == sorted(set((ex - 1 + 127).reshape(-1).tolist()))


def test_a_recorded_mx_run_keeps_block_statistics(tmp_path):
    """An MX model (TE's rceil rule) recorded, chunked and cut back: every cast's record holds its
    block statistics; the rceil scales clip nothing; the floor rule replayed from the record's
    block-relative histogram equals the analyzer's cast of the saved tensor."""
    import torch.nn as nn

    from fp8sim.trace import TraceReader
    from fp8sim.trace.truncate import truncate_trace
    from fp8sim.training import convert_to_fp8, record

    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32)), "mx")
    with record(model, tmp_path / "t", save_every=1, chunk_steps=2):
        for i in range(3):
            model(torch.randn(8, 64) * 10 ** i).square().mean().backward()
    tr = TraceReader(tmp_path / "t")
    recs = [r for r in tr.records() if not r.name.endswith("weight_grad")]
    assert recs and all(r.blocks is not None and r.blocks.kind == "e8m0" for r in recs)
    for r in recs:
        assert r.blocks.clipped == r.overflow == 0  # rceil never clips
        v = tensor_stats(tr.load_tensor(r.step, r.name), parse_variants(["e5m2"], ["mx"])).variants[0]
        assert mx_floor_counts(r.blocks, "e5m2", tr.hist_mantissa_bits)[:2] == (v.overflow, v.underflow)
    truncate_trace(tmp_path / "t", 1)  # a chunk cut back keeps its rows' block columns
    kept = [r for r in TraceReader(tmp_path / "t").records() if r.blocks is not None]
    assert kept and all(r.step == 1 for r in kept)
    assert [r.blocks.counts.tolist() for r in kept] == [r.blocks.counts.tolist() for r in recs if r.step == 1]


def test_a_per_tensor_recording_can_keep_what_mx_would_do(tmp_path):
    """record(block_stats="mx") on a plain model: each record's hypothetical MX statistics give
    the floor rule's counts of the saved tensor exactly, without loading it."""
    import torch.nn as nn

    from fp8sim.errors import ArgumentError
    from fp8sim.trace import TraceReader
    from fp8sim.training import record

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 32))
    with record(model, tmp_path / "t", save_every=1, block_stats="mx"):
        for i in range(2):
            model(_wide(8, 64, seed=i)).square().mean().backward()
    tr = TraceReader(tmp_path / "t")
    recs = list(tr.records())
    assert recs and all(r.blocks is not None and r.blocks.kind == "e8m0" for r in recs)
    for r in recs:
        v = tensor_stats(tr.load_tensor(r.step, r.name), parse_variants([r.format], ["mx"])).variants[0]
        over, under, exact = mx_floor_counts(r.blocks, r.format, tr.hist_mantissa_bits)
        assert (over, under) == (v.overflow, v.underflow) and r.blocks.clipped == v.overflow
    with pytest.raises(ArgumentError, match="block_stats"):
        record(model, tmp_path / "u", block_stats="nvfp4")


def test_mx_replays_from_block_statistics_without_saved_tensors(tmp_path):
    """replay's mx policy (the floor rule) over a trace that kept block-relative histograms but
    saved no tensor equals its replay from the saved tensors of the same run, record for record;
    mx:rceil, which the histogram cannot give, still needs saved tensors."""
    import torch.nn as nn

    from fp8sim.analysis import replay
    from fp8sim.training import record

    def run(path, save_every):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 32))
        with record(model, path, save_every=save_every, block_stats="mx"):
            for i in range(3):
                x = _wide(8, 64, seed=i)
                x[5, 32:64] = 0.5  # no block below 2**-112: every record replays from its histogram
                x[0, 0] = 1e-6 * x[0].abs().max()  # 2**-20 below its block's amax: lost by E4M3
                model(x).square().mean().backward()

    run(tmp_path / "saved", 1)
    run(tmp_path / "stats", 0)
    from_saved = replay(tmp_path / "saved", ["mx"], include_recorded=False, what_if=True)
    from_stats = replay(tmp_path / "stats", ["mx"], include_recorded=False, what_if=True)
    assert from_stats.policies[0].to_dict()["skipped"] == 0
    a, b = from_saved.records, from_stats.records
    assert len(a) == len(b) > 0
    assert [(r.step, r.tensor, r.scale, r.overflow, r.underflow, r.event) for r in a] == \
        [(r.step, r.tensor, r.scale, r.overflow, r.underflow, r.event) for r in b]  # fmt: skip
    assert sum(r.underflow[0] for r in b) > 0 and sum(r.overflow[0] for r in b) > 0  # both rules seen
    with pytest.raises(ValueError, match="saved no full tensor"):
        replay(tmp_path / "stats", ["mx:rceil"])

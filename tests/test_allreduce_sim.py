"""Single-process FP8 all-reduce simulation: sums vs numpy float64 + the emulator, the scaling
variants' multipliers, their under/overflow, AutoScale's mu over steps, replay over a trace."""

import math

import numpy as np
import pytest
import torch

import fp8sim
from fp8sim.trace import TraceWriter
from fp8sim.allreduce_sim import (
    decode_codes,
    ring_sum_codes,
    simulate_allreduce,
    sum_codes,
)
from fp8sim.analysis.allreduce_replay import format_allreduce_report, replay_allreduce

E4M3 = fp8sim.get_format("e4m3")


def _random_codes(n, shape, seed):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, size=(n, *shape), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
    return [torch.from_numpy(c) for c in codes]


@pytest.mark.parametrize("n", [2, 3, 8])
def test_sum_codes_is_one_rounding_of_the_exact_sum(n):
    chunks = _random_codes(n, (17, 9), seed=n)
    exact = sum(fp8sim.decode(c.numpy(), E4M3, dtype=np.float64) for c in chunks)  # float64, exact
    want = fp8sim.encode(exact, E4M3, saturate=True)
    got, over = sum_codes(chunks, E4M3)
    assert np.array_equal(got.numpy(), want)
    # E4M3 sums above 464 round above 448 (464 itself ties to the even 448): docs/numerics.md
    assert over == int((np.abs(exact) > 464).sum())


def test_ring_sum_rerounds_at_every_hop():
    chunks = _random_codes(3, (12,), seed=7)
    dec = [fp8sim.decode(c.numpy(), E4M3, dtype=np.float64) for c in chunks]
    want = np.empty(12, np.uint8)
    for j, sl in enumerate([slice(0, 4), slice(4, 8), slice(8, 12)]):  # chunk j starts at rank j+1
        order = [(j + 1) % 3, (j + 2) % 3, j]
        acc = dec[order[0]][sl]
        for r in order[1:]:
            acc = fp8sim.decode(fp8sim.encode(acc + dec[r][sl], E4M3), E4M3, dtype=np.float64)
        want[sl] = fp8sim.encode(acc, E4M3)
    got, _ = ring_sum_codes(chunks, E4M3)
    assert np.array_equal(got.numpy(), want)
    two = _random_codes(2, (40,), seed=8)  # one hop: the same single rounding as the exact sum
    assert torch.equal(ring_sum_codes(two, E4M3)[0], sum_codes(two, E4M3)[0])


def test_multipliers_by_hand():
    g = [torch.tensor([3.0, -1.0, 0.5]), torch.tensor([-2.0, 0.25, 1.0])]  # global amax 3
    s = np.float32(448) / np.float32(3)
    ks = {m: simulate_allreduce(g, method=m)[1].k for m in ("pre", "post", "msamp", "autoscale")}
    assert ks["post"] == float(s) and ks["pre"] == float(np.float32(s / 2))
    assert ks["msamp"] == pytest.approx(128 / math.sqrt(2), rel=1e-7)  # 2**floor(log2 149.3) / sqrt(2)
    assert ks["autoscale"] == float(s)  # mu starts at 1


def test_result_is_one_fp8_rounding_of_the_average_of_the_quantized_gradients():
    torch.manual_seed(0)
    grads = [torch.randn(33, 20) * 1e-3 for _ in range(4)]
    avg, st = simulate_allreduce(grads, method="pre")
    k = torch.tensor(st.k)
    deq = [decode_codes(fp8sim.encode(g * k, E4M3), E4M3).double() for g in grads]  # per-rank FP8 values
    s = sum(deq)  # the exact sum of the quantized gradients, in units of k
    a = s.abs()
    half_ulp = 2.0 ** (torch.floor(torch.log2(torch.clamp(a, min=2.0**-6))) - 4)
    assert st.overflow_sum == 0
    f32_slop = torch.from_numpy(np.spacing(avg.abs().numpy())).double()  # the float32 division
    assert torch.all((avg.double() - s / (k.double() * 4)).abs() <= half_ulp / (k.double() * 4) + f32_slop)
    assert st.rel_error < 0.1 and st.snr_db > 20


def test_pre_scaling_underflows_post_scaling_overflows():
    amax = 1.0
    hi = torch.zeros(64)
    hi[0] = amax  # both ranks: the max at the same place, same sign -> the sum doubles it
    tiny = torch.full((64,), amax * 2.0**-17)
    tiny[0] = amax
    grads = [hi + 0, tiny + 0, tiny + 0, tiny + 0]  # N = 4
    # post: 448 * 2**-17 = 0.0034 survives (>= half the smallest subnormal 2**-10); sum of maxima 4*448 overflows
    _, post = simulate_allreduce(grads, method="post")
    # pre: 0.0034 / 4 < 2**-10 underflows to zero; the sum of maxima is 448: no overflow
    _, pre = simulate_allreduce(grads, method="pre")
    assert post.overflow_sum == 1 and post.underflow_in == 0
    assert pre.overflow_sum == 0 and pre.underflow_in == 3 * 63
    assert pre.underflow_share == pytest.approx(3 * 63 / (1 + 3 * 64))


def test_autoscale_mu_halves_on_saturated_sums_then_regrows():
    from fp8sim.policies import parse_policy

    policy = parse_policy("autoscale:window=10")
    g = torch.linspace(-1, 1, 101)
    mus, overflow = [], []
    for _ in range(6):  # two identical ranks: the sum is 2 * mu * 448 at the ends
        _, st = simulate_allreduce([g, g], method="autoscale", policy=policy, name="w")
        mus.append(st.mu)
        overflow.append(st.overflow_sum)
    # mu 1: sums of 896 saturate; mu 1/2: the ends land exactly on 448 (still "at max"); then 1/4
    # and geometric regrowth mu_k = mu_0 * (2 / mu_0) ** (k / window) after k clean steps
    assert mus[:3] == [1.0, 0.5, 0.25]
    assert mus[3:] == pytest.approx([0.25 * 8 ** (k / 10) for k in (1, 2, 3)])
    per_rank = fp8sim.decode(fp8sim.encode(g.numpy() * np.float32(448), E4M3), E4M3, dtype=np.float64)
    assert overflow[0] == int((np.abs(2 * per_rank) > 464).sum()) > 0 and overflow[1:] == [0] * 5


def _write_rank_traces(root, ranks=2, steps=(1, 3), seed=0):
    torch.manual_seed(seed)
    for r in range(ranks):
        with TraceWriter(root / f"rank{r}", {"rank": r}) as tw:
            for name, shape in (("h.0.c_fc.weight_grad", (32, 16)), ("h.0.c_proj.weight_grad", (16, 32))):
                tw.add_tensor(name, "weight_grad", "e4m3", shape)
            tw.add_tensor("h.0.c_fc.input", "activation", "e4m3", (4, 16))
            for step in steps:
                for name, shape in (("h.0.c_fc.weight_grad", (32, 16)), ("h.0.c_proj.weight_grad", (16, 32))):
                    x = torch.randn(shape) * 1e-3 * torch.exp(torch.randn(shape))
                    tw.record(step, name, x, scale=1.0)
                    tw.save_tensor(step, name, x)
                a = torch.randn(4, 16)
                tw.record(step, "h.0.c_fc.input", a, scale=1.0)
                tw.save_tensor(step, "h.0.c_fc.input", a)  # not a weight gradient: ignored


def test_replay_over_rank_traces(tmp_path):
    _write_rank_traces(tmp_path)
    res = replay_allreduce(tmp_path, 2)
    assert res["source"] == "ranks" and res["records"] == 4 and res["steps"] == [1, 3]
    rows = {(r["method"], r["reduce"]): r for r in res["rows"]}
    assert len(rows) == 8
    assert all(r["numel"] == 4 * 512 for r in rows.values())  # 2 steps x 2 tensors
    # the same records through simulate_allreduce directly
    from fp8sim.trace import TraceReader

    r0, r1 = TraceReader(tmp_path / "rank0"), TraceReader(tmp_path / "rank1")
    errs = [simulate_allreduce([r0.load_tensor(s, n), r1.load_tensor(s, n)], method="pre")[1].rel_error
            for s, n in sorted(set(r0.saved_tensors())) if n.endswith("weight_grad")]
    assert rows[("pre", "exact")]["rel_error_mean"] == pytest.approx(np.mean(errs))
    assert rows[("pre", "exact")]["underflow_share"] >= rows[("post", "exact")]["underflow_share"]
    text = format_allreduce_report(res)
    assert "per-rank traces" in text and "autoscale" in text
    with pytest.raises(ValueError, match="2 ranks, --allreduce asks for 3"):
        replay_allreduce(tmp_path, 3)


def test_replay_single_trace_uses_steps_as_ranks(tmp_path):
    _write_rank_traces(tmp_path, ranks=1, steps=(1, 2, 3, 4, 5))
    res = replay_allreduce(tmp_path / "rank0", 2, methods=["autoscale"], reductions=["exact"])
    assert res["source"] == "steps-as-ranks" and res["steps"] == [1, 3]  # (1,2), (3,4); 5 left over
    assert res["records"] == 4 and set(res["rows"][0]["mu"]) == {"h.0.c_fc.weight_grad", "h.0.c_proj.weight_grad"}
    with pytest.raises(ValueError, match="not an fp8sim trace"):
        replay_allreduce(tmp_path / "nope", 2)


def test_replay_cli_allreduce(tmp_path, capsys):
    import json

    from fp8sim import cli

    _write_rank_traces(tmp_path)
    assert cli.main(["replay", str(tmp_path), "--allreduce", "2", "--json", "-"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["source"] == "ranks" and out["ranks"] == 2 and len(out["rows"]) == 8
    assert cli.main(["replay", str(tmp_path), "--allreduce", "2"]) == 0
    assert "FP8 all-reduce over 2 ranks" in capsys.readouterr().out
    assert cli.main(["replay", str(tmp_path), "--allreduce", "2", "--policy", "current"]) == 2
    assert cli.main(["replay", str(tmp_path), "--allreduce", "1"]) == 2


def test_tensors_saved_by_some_ranks_only_are_named(tmp_path):
    _write_rank_traces(tmp_path, steps=(1, 3))
    gone = [f for f in (tmp_path / "rank1" / "tensors").iterdir() if f.name.startswith("00000003-")]
    assert gone
    for f in gone:
        f.unlink()  # rank 1 lost its step-3 saves
    res = replay_allreduce(tmp_path, 2, methods=["pre"], reductions=["exact"])
    assert res["steps"] == [1] and res["records"] == 2
    assert res["incomplete"] == [[3, "h.0.c_fc.weight_grad"], [3, "h.0.c_proj.weight_grad"]]
    assert "note: 2 (step, tensor) pairs saved by only some ranks left out" in format_allreduce_report(res)


def test_the_old_module_path_still_resolves_with_a_warning():
    import pytest

    from fp8sim.allreduce_sim import sum_codes as core_sum
    from fp8sim.analysis.allreduce_replay import replay_allreduce as moved

    import fp8sim.training.allreduce_sim as old

    with pytest.warns(DeprecationWarning, match="moved to fp8sim.allreduce_sim.sum_codes"):
        assert old.sum_codes is core_sum
    with pytest.warns(DeprecationWarning, match="fp8sim.analysis.allreduce_replay.replay_allreduce"):
        assert old.replay_allreduce is moved

"""FP8-LM AdamW: state formats, one step against torch.optim.AdamW within the state's rounding,
and 100 steps tracking torch.optim.AdamW on a toy regression."""

import numpy as np
import pytest
import torch

from fp8sim.training.optim import Fp8AdamW, update_bound

HP = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def half_ulp_fp16(y: np.ndarray) -> np.ndarray:
    """Half the float16 spacing above |y| (numpy): an upper bound of one RNE rounding error."""
    return np.spacing(np.abs(y).astype(np.float16)).astype(np.float64) / 2


def half_ulp_e4m3(y: np.ndarray) -> np.ndarray:
    """Half the E4M3 spacing at |y| (3 mantissa bits; subnormal spacing 2**-9 below 2**-6)."""
    a = np.abs(y).astype(np.float64)
    e = np.floor(np.log2(np.maximum(a, 2.0**-6)))
    return 2.0 ** (e - 3) / 2


def _pair(shape=(37, 24), seed=0):
    torch.manual_seed(seed)
    p8 = torch.nn.Parameter(torch.randn(shape) * 0.3)
    opt8 = Fp8AdamW([p8], **HP)
    pref = torch.nn.Parameter(p8.detach().clone())
    ref = torch.optim.AdamW([pref], **HP, foreach=False)
    return p8, opt8, pref, ref


def test_state_formats_and_bytes():
    p8, opt8, _, _ = _pair()
    st = opt8.state[p8]
    assert st["master"].dtype == torch.float16 and st["exp_avg"].dtype == torch.uint8
    assert st["exp_avg_sq"].dtype == torch.float16
    # the parameter starts at its FP16 master's value (a float16 value times a power of two)
    assert torch.equal(p8.detach(), opt8.master_value(p8))
    assert torch.allclose(p8.detach(), p8.detach().half().float(), rtol=2**-11, atol=0)
    b = opt8.state_bytes()
    n = p8.numel()
    assert (b["master"], b["exp_avg"], b["exp_avg_sq"]) == (2 * n, n, 2 * n)  # 5 bytes/param + scales


def test_single_steps_match_torch_adamw_within_state_rounding():
    """From the same (decoded) state, one step of each: the FP8 state differs from torch's float32
    one by at most one rounding of each stored tensor (fp16 / e4m3 half-ulps, plus float32 slop
    for torch's different operation order)."""
    p8, opt8, pref, ref = _pair()
    gen = torch.Generator().manual_seed(1)
    for t, mag in enumerate([1e-3, 1e2, 1e-5, 1.0], start=1):  # magnitude jumps: no saturation
        g = torch.randn(p8.shape, generator=gen) * mag
        m_old, v_old = opt8.moments(p8)
        with torch.no_grad():
            pref.copy_(p8)
        ref.state[pref] = {"step": torch.tensor(float(t - 1)), "exp_avg": m_old.clone(), "exp_avg_sq": v_old.clone()}
        p8.grad, pref.grad = g.clone(), g.clone()
        opt8.step()
        ref.step()
        st = opt8.state[p8]
        w, w_ref = p8.detach().double().numpy(), pref.detach().double().numpy()
        s_w = 1 / float(st["master_scale_inv"])
        tol_w = half_ulp_fp16(w * s_w) / s_w + 16 * np.spacing(np.abs(w_ref).astype(np.float32))
        assert np.all(np.abs(w - w_ref) <= tol_w), t
        m, v = (x.double().numpy() for x in opt8.moments(p8))
        m_ref, v_ref = ref.state[pref]["exp_avg"].double().numpy(), ref.state[pref]["exp_avg_sq"].double().numpy()
        s_m, s_v = 1 / float(st["exp_avg_scale_inv"]), 1 / float(st["exp_avg_sq_scale_inv"])
        assert np.all(np.abs(m - m_ref) <= half_ulp_e4m3(m_ref * s_m) / s_m + 4 * np.spacing(np.abs(m_ref).astype(np.float32)))
        assert np.all(np.abs(v - v_ref) <= half_ulp_fp16(v_ref * s_v) / s_v + 4 * np.spacing(np.abs(v_ref).astype(np.float32)))
        # the scales are powers of two and the moments use their range: amax within one binade
        assert np.frexp(s_m)[0] == 0.5 and np.abs(m * s_m).max() > 448 / 4, t


def test_update_bound_holds_for_random_gradient_streams():
    # |m_hat| / sqrt(v_hat) never exceeds the Cauchy-Schwarz bound (float64 Adam recursions)
    rng = np.random.default_rng(2)
    b1, b2 = 0.9, 0.95
    g = rng.standard_normal((200, 500)) * np.exp(rng.standard_normal((200, 1)) * 3)
    g[:, :50] = np.abs(g[:, :50])  # one-signed streams push the ratio to its bound
    m = np.zeros(500)
    v = np.zeros(500)
    for t in range(1, 201):
        m = b1 * m + (1 - b1) * g[t - 1]
        v = b2 * v + (1 - b2) * g[t - 1] ** 2
        ratio = np.abs(m / (1 - b1**t)) / np.sqrt(v / (1 - b2**t))
        assert ratio.max() <= update_bound(t, b1, b2) * (1 + 1e-12)
    assert update_bound(1, b1, b2) == pytest.approx(1.0)


def _toy_run(fmt: str | None, steps: int = 100, lr: float = 0.1) -> tuple[list[torch.Tensor], list[float]]:
    """Least squares, 12x24 weights, cosine learning rate to 0: AdamW (fmt None) or Fp8AdamW
    with first moments in ``fmt``. Returns the weights and the loss after every step."""
    import math

    torch.manual_seed(3)
    x = torch.randn(256, 24)
    y = x @ torch.randn(12, 24).t() + 0.01 * torch.randn(256, 12)
    p = torch.nn.Parameter(torch.randn(12, 24) * 0.3)
    hp = dict(HP, lr=lr, weight_decay=0.0)
    if fmt is None:
        p.data = p.data.half().float()  # the FP8 run's start: its FP16 master (exact here)
        opt = torch.optim.AdamW([p], **hp, foreach=False)
    else:
        opt = Fp8AdamW([p], **hp, exp_avg_fmt=fmt)
    weights, losses = [p.detach().clone()], []
    for t in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * t / steps))
        opt.zero_grad()
        loss = ((x @ p.t() - y) ** 2).mean()
        loss.backward()
        opt.step()
        weights.append(p.detach().clone())
        losses.append(float(loss.detach()))
    return weights, losses


def test_tracks_torch_adamw_over_100_steps():
    """100 steps of a toy regression from the same start: the FP8 weights stay within 10% of the
    distance the float32 run travels, end within 2% of it, and the gap shrinks with the first
    moment's mantissa bits (e5m2 > e4m3 > e3m4): it is the quantization error, nothing else."""
    ref_w, ref_l = _toy_run(None)
    assert torch.equal(ref_w[0], _toy_run("e4m3", steps=0)[0][0])
    travelled = float((ref_w[-1] - ref_w[0]).abs().max())
    drift = {}
    for fmt in ("e3m4", "e4m3", "e5m2"):
        w, losses = _toy_run(fmt)
        assert losses[-1] < losses[0] / 1000, fmt
        gaps = [float((a - b).abs().max()) / travelled for a, b in zip(w, ref_w)]
        drift[fmt] = max(gaps)
        if fmt == "e4m3":
            assert max(gaps) <= 0.10 and gaps[-1] <= 0.02
    assert ref_l[-1] < ref_l[0] / 1000
    assert drift["e3m4"] < drift["e4m3"] < drift["e5m2"], drift


def test_grad_scale_and_grad_source():
    torch.manual_seed(5)
    a = torch.nn.Parameter(torch.randn(9, 7))
    b = torch.nn.Parameter(a.detach().clone())
    g = torch.randn(9, 7)
    opt_a = Fp8AdamW([a], **HP)
    opt_b = Fp8AdamW([b], **HP, grad_source=lambda p: (g * 4, 0.125))
    a.grad = g.clone()
    opt_a.step(grad_scale=0.5)  # g * 0.5 == (4 g) * 0.125 exactly
    opt_b.step()
    assert torch.equal(a.detach(), b.detach())
    assert torch.equal(opt_a.state[a]["exp_avg"], opt_b.state[b]["exp_avg"])


def test_validation():
    p = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="beta1\\*\\*2 < beta2"):
        Fp8AdamW([p], betas=(0.99, 0.9))
    with pytest.raises(TypeError, match="float32"):
        Fp8AdamW([torch.nn.Parameter(torch.randn(3, dtype=torch.float64))])
    with pytest.raises(ValueError, match="stochastic"):
        Fp8AdamW([p], rounding="stochastic")

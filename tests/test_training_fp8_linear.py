"""FP8 linear layers against an independent reference (ml_dtypes casts, numpy float64 GEMMs)."""

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fp8sim.training import GPT, GPTConfig, convert_to_fp8, get_fp8_state, get_recipe
from fp8sim.training.fp8_linear import Fp8Linear
from fp8sim.formats import get_format
from fp8sim.recipes import CastConfig, LinearRecipe
from fp8sim.scaling_config import StaticScalingConfig


pytestmark = pytest.mark.usefixtures("one_torch_thread")

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


def _layer(recipe, backend="emulator", k=64, n=48, seed=0, **kwargs):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(k, n))
    convert_to_fp8(model, recipe, backend, **kwargs)
    return model, model[0]


def _cast_ref(x: np.ndarray, scale: np.float32, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(codes as float64 values, ml_dtypes array) of float32(x * scale); ml_dtypes rounds to
    nearest even and does not saturate (overflow -> NaN in e4m3fn, inf in e5m2)."""
    q = (x.astype(np.float32) * np.float32(scale)).astype(dtype)
    return q.astype(np.float64), q


def _current_scale(x: np.ndarray, fmax: float) -> np.float32:
    return np.float32(fmax) / np.float32(np.abs(x).max())


def test_convert_replaces_linears_explicitly():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32))
    params_before = {n: p for n, p in model.named_parameters()}
    convert_to_fp8(model, get_recipe("te-delayed"))
    fp8 = {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert fp8 == {f"blocks.{i}.{s}" for i in range(2) for s in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.wte.weight  # head stays, tied
    assert {n: p for n, p in model.named_parameters()} == params_before  # same Parameter objects
    # nothing global: a fresh nn.Linear and F.linear behave as before
    lin = nn.Linear(8, 4)
    x = torch.randn(3, 8)
    assert torch.equal(lin(x), x @ lin.weight.t() + lin.bias) and F.linear is torch._C._nn.linear
    with pytest.raises(ValueError, match="already converted"):
        convert_to_fp8(model, get_recipe("te-delayed"))
    with pytest.raises(ValueError, match="no FP8 linear"):
        convert_to_fp8(nn.Sequential(nn.Linear(2, 2)), get_recipe("bf16"))


@pytest.mark.parametrize("backend", ["emulator", "torch"])
@pytest.mark.parametrize("accumulate", ["float64", "float32"])
def test_forward_backward_match_reference_current_scaling(accumulate, backend):
    model, layer = _layer(get_recipe("te-current"), backend, gemm_accumulate=accumulate)
    rng = np.random.default_rng(1)
    x_np = rng.standard_normal((37, 64)).astype(np.float32) * 3
    gy_np = rng.standard_normal((37, 48)).astype(np.float32) * 1e-3
    x = torch.from_numpy(x_np).requires_grad_()
    y = model(x)
    y.backward(torch.from_numpy(gy_np))

    w_np = layer.weight.detach().numpy()
    sx, sw, sg = _current_scale(x_np, 448), _current_scale(w_np, 448), _current_scale(gy_np, 57344)
    xq, _ = _cast_ref(x_np, sx, E4M3)
    wq, _ = _cast_ref(w_np, sw, E4M3)
    gq, _ = _cast_ref(gy_np, sg, E5M2)
    inv = lambda s: np.float64(np.float32(1) / s)  # noqa: E731  scale_inv rounded to float32
    if accumulate == "float64":  # exact products summed in float64, scaled, rounded once
        y_ref = ((xq @ wq.T) * inv(sx) * inv(sw)).astype(np.float32)
        dx_ref = ((gq @ wq) * inv(sg) * inv(sw)).astype(np.float32)
        dw_ref = ((gq.T @ xq) * inv(sg) * inv(sx)).astype(np.float32)
    else:  # torch.mm of the float32 values in the codes' layouts, times float32(sA * sB)
        X, W, G = (torch.from_numpy(q.astype(np.float32)) for q in (xq, wq, gq))
        f = lambda a, b: torch.tensor(np.float32(inv(a)) * np.float32(inv(b)))  # noqa: E731
        y_ref = (torch.mm(X, W.t()) * f(sx, sw)).numpy()
        dx_ref = (torch.mm(G, W) * f(sg, sw)).numpy()
        dw_ref = (torch.mm(G.t(), X) * f(sg, sx)).numpy()
    y_ref = y_ref + layer.bias.detach().numpy()
    assert np.array_equal(y.detach().numpy(), y_ref)
    np.testing.assert_array_equal(x.grad.numpy(), dx_ref)
    np.testing.assert_array_equal(layer.weight.grad.numpy(), dw_ref)
    np.testing.assert_allclose(layer.bias.grad.numpy(), gy_np.astype(np.float64).sum(0), rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("accumulate", ["float32", "float64"])
def test_torch_backend_matches_emulator_codes_and_values(accumulate):
    rng = np.random.default_rng(2)
    x_np = rng.standard_normal((40, 64)).astype(np.float32)
    outs = {}
    for backend in ("emulator", "torch"):
        model, layer = _layer(get_recipe("te-current"), backend, gemm_accumulate=accumulate)
        seen = []
        get_fp8_state(model).taps.append(lambda name, role, x, cast, scale, op: seen.append((name, op.codes.clone(), float(op.scale_inv))))
        x = torch.from_numpy(x_np).requires_grad_()
        y = model(x)
        y.square().sum().backward()
        outs[backend] = (seen, y.detach(), x.grad)
    (se, ye, ge), (st, yt, gt) = outs["emulator"], outs["torch"]
    assert [s[0] for s in se] == ["0.input", "0.weight", "0.grad_output"] == [s[0] for s in st]
    for a, b in zip(se, st):
        assert torch.equal(a[1], b[1]) and a[2] == b[2]
    # same codes, same GEMM arithmetic (one shared function for float32): the same bits
    assert torch.equal(yt, ye) and torch.equal(gt, ge)


def test_gemm_accumulate_choice():
    from fp8sim.backends.emulator import EmulatorBackend

    model, _ = _layer(get_recipe("te-delayed"), "torch")
    st = get_fp8_state(model)
    assert st.gemm_accumulate == "float32"  # the training default
    st.gemm_accumulate = "float64"
    assert st.gemm_accumulate == "float64"
    with pytest.raises(ValueError, match="gemm_accumulate"):
        st.gemm_accumulate = "float16"

    class OwnGemm(EmulatorBackend):  # a backend whose scaled_mm takes no accumulate= (Triton)
        gemm_accumulations = ()

        def scaled_mm(self, *args, out_dtype=torch.float32):
            calls.append(out_dtype)
            return super().scaled_mm(*args, out_dtype=out_dtype, accumulate="float32")

    calls = []
    model, _ = _layer(get_recipe("te-delayed"), OwnGemm())
    assert get_fp8_state(model).gemm_accumulate is None  # float32 asked: the backend's own
    model(torch.randn(5, 64)).sum().backward()
    assert calls == [torch.float32] * 3
    with pytest.raises(NotImplementedError, match="float64"):
        _layer(get_recipe("te-delayed"), OwnGemm(), gemm_accumulate="float64")


def test_overflow_underflow_counts_match_ml_dtypes():
    static = CastConfig(get_format("e4m3"), StaticScalingConfig(1000.0))
    recipe = LinearRecipe(input=static, weight=CastConfig(get_format("e4m3")), grad_output=CastConfig(get_format("e5m2")))
    model, layer = _layer(recipe, "torch")
    rng = np.random.default_rng(3)
    x_np = (rng.standard_normal((16, 64)) * np.exp(rng.uniform(-14, 0, (16, 64)))).astype(np.float32)
    x_np[0, :3] = [0.0, -0.0, 0.448]  # zeros never underflow; 0.448 * 1000 = 448 is max, no overflow
    model(torch.from_numpy(x_np))  # a training forward: only those count (no_grad ones do not)
    ev = get_fp8_state(model).pop_events()
    _, q = _cast_ref(x_np, np.float32(1000), E4M3)
    qf = q.astype(np.float32)
    over_ref = int(np.isnan(qf).sum())  # ml_dtypes e4m3fn: overflow -> NaN
    under_ref = int(((qf == 0) & (x_np != 0)).sum())
    # the weight (current scaling) neither overflows nor, at this size, underflows much: count it
    w_np = layer.weight.detach().numpy()
    _, qw = _cast_ref(w_np, _current_scale(w_np, 448), E4M3)
    under_ref += int(((qw.astype(np.float32) == 0) & (w_np != 0)).sum())
    assert over_ref > 10 and under_ref > 10
    assert ev == {"overflow": over_ref, "underflow": under_ref}


def test_delayed_scaling_uses_previous_amax_and_eval_leaves_policies_alone():
    model, layer = _layer(get_recipe("te-delayed"), "emulator")
    state = get_fp8_state(model)
    scales = []
    state.taps.append(lambda name, role, x, cast, scale, op: scales.append((name, scale, float(x.abs().max()))))
    xs = [torch.randn(8, 64) * (i + 1) for i in range(3)]
    for x in xs:
        model(x).sum().backward()
    inp = [s for s in scales if s[0] == "0.input"]
    assert inp[0][1] == 1.0  # Transformer Engine: the first step casts with scale 1
    # step t uses fmax / max(amax history) of the steps before it (history 16 > 3 steps)
    assert inp[1][1] == np.float32(448) / np.float32(inp[0][2])
    assert inp[2][1] == np.float32(448) / np.float32(max(inp[0][2], inp[1][2]))
    before = state.state_dict()
    state.observing = False
    n = len(scales)
    with torch.no_grad():
        model(torch.randn(8, 64) * 100)
    state.observing = True
    assert state.state_dict() == before and len(scales) == n


@pytest.mark.parametrize("k", [64, 50])  # 50: a last MX block of 18 elements
def test_mx_forward_matches_block_reference(k):
    model, layer = _layer(get_recipe("mx"), "emulator", k=k, n=32)
    rng = np.random.default_rng(4)
    x_np = (rng.standard_normal((5, k)) * np.exp(rng.uniform(-6, 6, (5, k)))).astype(np.float32)

    def mx_ref(a):  # one power-of-two scale X per 32 elements along rows; rceil: X >= amax / 448
        out = np.empty(a.shape, np.float64)
        for r in range(a.shape[0]):
            for b in range(0, a.shape[1], 32):
                blk = a[r, b : b + 32]
                e = int(np.ceil(np.log2(np.float32(np.abs(blk).max()) * np.float32(1 / 448))))
                out[r, b : b + 32] = (blk / np.float32(2.0**e)).astype(E4M3).astype(np.float64) * 2.0**e
        return out

    with torch.no_grad():
        y = model(torch.from_numpy(x_np)).numpy()
    ref = mx_ref(x_np) @ mx_ref(layer.weight.detach().numpy()).T + layer.bias.detach().numpy()
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("m,k", [(32, 64), (35, 50), (50, 50)])  # ragged MX blocks on M and K
def test_mx_backward_close_to_float32(m, k):
    # MX re-casts each operand along the reduction axis of each backward GEMM: gradients stay
    # within E4M3's precision (2**-4 relative per element) of the float32 gradients
    model, layer = _layer(get_recipe("mx"), "emulator", k=k, n=64)
    ref = nn.Linear(k, 64)
    ref.load_state_dict({"weight": layer.weight.detach(), "bias": layer.bias.detach()})
    x = torch.randn(m, k)
    x[:, 32:] *= 1000  # blocks of very different scale along K and M: a misplaced scale shows
    x[32:, :] *= 1000
    gy = torch.randn(m, 64)
    gy[32:] *= 1000
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    model(x1).backward(gy)
    ref(x2).backward(gy)
    for got, want in ((x1.grad, x2.grad), (layer.weight.grad, ref.weight.grad)):
        rel = float((got - want).norm() / want.norm())
        assert 1e-4 < rel < 0.08

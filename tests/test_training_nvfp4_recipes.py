"""The NVFP4 and Float8BlockScaling training recipes, checked against manual computations with
the numerics modules (fp8sim.nvfp4, fp8sim.hadamard, fp8sim.scaling), bit for bit."""

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn as nn

from fp8sim.emulator import decode
from fp8sim.hadamard import rht
from fp8sim.nvfp4 import gemm_alpha, quantize_nvfp4_2d
from fp8sim.scaling import quantize_scaled
from fp8sim.formats import get_format
from fp8sim.granularity import Granularity
from fp8sim.scaling_config import CurrentScalingConfig
from fp8sim.training import GPT, GPTConfig, convert_to_fp8, get_fp8_state, get_recipe
from fp8sim.training.fp8_linear import Fp8Linear

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW = ("nvfp4", "nvfp4-no-rht", "nvfp4-no-sr", "nvfp4-no-rht-no-sr", "te-block")


def _layer(recipe, k, n, backend="emulator", seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(k, n))
    convert_to_fp8(model, recipe, backend)
    return model, model[0]


def _data(m, k, n, seed=1):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, k)) * np.exp(rng.standard_normal((m, 1)))).astype(np.float32)
    gy = (rng.standard_normal((m, n)) * 1e-3).astype(np.float32)
    return x, gy


def _values(codes: np.ndarray, block_scale: np.ndarray, tile) -> torch.Tensor:
    """e2m1 value times the decoded E4M3 block scale (exact), as TE's reference GEMM scales."""
    r, c = tile
    rows, cols = codes.shape
    full = np.repeat(np.repeat(block_scale, r, axis=0)[:rows], c, axis=1)[:, :cols]
    return torch.from_numpy(decode(codes, "e2m1") * full)


def _mm(a_vals, a_parts, b_vals, b_parts) -> torch.Tensor:
    """float32(torch.mm(A, B^T) * alpha) with B^T a transposed view, as the training GEMM does."""
    alpha = gemm_alpha(a_parts.tensor_scale, b_parts.tensor_scale, "te")
    return torch.mm(a_vals, b_vals.t()) * torch.tensor(alpha)


def _pad16(a: np.ndarray) -> np.ndarray:
    return np.pad(a, ((0, 0), (0, -a.shape[1] % 16)))


def test_recipes_registered_with_te_defaults():
    nv = get_recipe("nvfp4").linear
    assert {c.fmt.name for c in (nv.input, nv.weight, nv.grad_output)} == {"e2m1"}
    assert (nv.input.granularity.spec, nv.weight.granularity.spec, nv.grad_output.granularity.spec) == (
        "nvfp4", "nvfp4:2d", "nvfp4")
    assert nv.input.rht and nv.grad_output.rht and not nv.weight.rht
    assert nv.grad_output.rounding == "stochastic" and nv.input.rounding == nv.weight.rounding == "rne"
    assert nv.skip == ("lm_head",) and nv.keep_last_blocks == 0
    assert not get_recipe("nvfp4-no-rht").linear.input.rht
    assert get_recipe("nvfp4-no-rht").linear.grad_output.rounding == "stochastic"
    assert get_recipe("nvfp4-no-sr").linear.grad_output.rounding == "rne"
    assert get_recipe("nvfp4-no-sr").linear.grad_output.rht
    tb = get_recipe("te-block").linear  # Float8BlockScaling(): E4M3 both ways, pow2 scales, epsilon 0
    assert {c.fmt.name for c in tb.casts().values()} == {"e4m3"}
    assert (tb.input.granularity.spec, tb.weight.granularity.spec, tb.grad_output.granularity.spec) == (
        "block:1x128", "block:128x128", "block:1x128")
    assert {c.scaling for c in tb.casts().values()} == {CurrentScalingConfig(pow2=True)}


def test_recipe_validation():
    from fp8sim.recipes import CastConfig, LinearRecipe

    e4m3, e2m1 = get_format("e4m3"), get_format("e2m1")
    with pytest.raises(ValueError, match="casts to e2m1"):
        CastConfig(e4m3, granularity=Granularity.nvfp4())
    with pytest.raises(ValueError, match="one-row blocks"):
        LinearRecipe(*(CastConfig(e4m3, granularity=Granularity.blocks(128, 1)),) * 3)
    with pytest.raises(ValueError, match="rht"):
        CastConfig(e4m3, granularity=Granularity.blocks(1, 128), rht=True)
    nv = CastConfig(e2m1, granularity=Granularity.nvfp4(), rht=True)
    with pytest.raises(ValueError, match="both weight-gradient GEMM operands"):
        LinearRecipe(nv, CastConfig(e2m1, granularity=Granularity.nvfp4("2d")), dataclasses.replace(nv, rht=False))
    one_d = CastConfig(e4m3, granularity=Granularity.blocks(1, 128))
    with pytest.raises(ValueError, match="all in nvfp4"):
        LinearRecipe(one_d, CastConfig(e2m1, granularity=Granularity.nvfp4("2d")), one_d)
    with pytest.raises(ValueError, match="accumulate in float32"):  # not silently a float32 GEMM
        convert_to_fp8(nn.Sequential(nn.Linear(32, 16)), "te-block", gemm_accumulate="float64")
    with pytest.raises(ValueError, match="keep_last_blocks"):
        dataclasses.replace(get_recipe("nvfp4").linear, keep_last_blocks=-1)


@pytest.mark.parametrize("name", NEW)
def test_new_recipes_train_with_finite_loss(name):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32))
    convert_to_fp8(model, get_recipe(name), "emulator")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(3):
        _, loss = model(idx, idx)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("name,rht_on", [("nvfp4-no-sr", True), ("nvfp4-no-rht-no-sr", False)])
def test_nvfp4_layer_bit_exact_with_manual_rht(name, rht_on):
    """Forward, dgrad and wgrad of one layer against fp8sim.nvfp4 + fp8sim.hadamard by hand:
    1x16 input and gradient, 16x16 weight, the RHT (TE's signs) on both wgrad operands along the
    37 tokens (padded with zeros to 48), per-GEMM alpha from the two tensor scales."""
    m, k, n = 37, 40, 24  # ragged everywhere: 40 = 2.5 blocks, 24 = 1.5 tiles, 37 tokens
    model, layer = _layer(get_recipe(name), k, n)
    x_np, gy_np = _data(m, k, n)
    x = torch.from_numpy(x_np).requires_grad_()
    y = model(x)
    y.backward(torch.from_numpy(gy_np))

    w_np = layer.weight.detach().numpy()
    xq = quantize_nvfp4_2d(x_np, (1, 16))
    wq = quantize_nvfp4_2d(w_np, (16, 16))
    y_ref = _mm(_values(xq.codes, xq.block_scale, (1, 16)), xq, _values(wq.codes, wq.block_scale, (16, 16)), wq)
    y_ref = y_ref + layer.bias.detach()
    assert torch.equal(y.detach(), y_ref)

    gq = quantize_nvfp4_2d(gy_np, (1, 16))
    wt = _values(wq.codes.T.copy(), wq.block_scale.T.copy(), (16, 16))  # the forward's W, transposed
    dx_ref = _mm(_values(gq.codes, gq.block_scale, (1, 16)), gq, wt, wq)
    assert torch.equal(x.grad, dx_ref)

    def wgrad_operand(a):  # (features, tokens): padded to 48 tokens, transformed, 1x16 along tokens
        a = _pad16(np.ascontiguousarray(a.T))
        return quantize_nvfp4_2d(rht(a, -1, "te") if rht_on else a, (1, 16))

    gt, xt = wgrad_operand(gy_np), wgrad_operand(x_np)
    dw_ref = _mm(_values(gt.codes, gt.block_scale, (1, 16)), gt, _values(xt.codes, xt.block_scale, (1, 16)), xt)
    assert torch.equal(layer.weight.grad, dw_ref)
    assert torch.equal(layer.bias.grad, torch.from_numpy(gy_np).sum(0))
    # the transform matters: the other choice gives another weight gradient (same forward)
    other = quantize_nvfp4_2d(_pad16(np.ascontiguousarray(x_np.T)) if rht_on else
                              rht(_pad16(np.ascontiguousarray(x_np.T)), -1, "te"), (1, 16))
    assert not np.array_equal(other.codes, xt.codes)


def _record_gemms(state):
    """The operand pairs of every FP8 GEMM the layers run (through Fp8State.grouped_gemm, one
    call per forward or backward, one pair per GEMM)."""
    seen = []
    grouped = state.grouped_gemm

    def recording(a, b):
        seen.extend(zip(a, b))
        return grouped(a, b)

    state.grouped_gemm = recording
    return seen


@pytest.mark.parametrize("name,k,n", [("nvfp4", 40, 24), ("te-block", 200, 130)])
def test_forward_and_backward_see_the_same_quantized_weight(name, k, n):
    model, layer = _layer(get_recipe(name), k, n)
    seen = _record_gemms(get_fp8_state(model))
    x_np, gy_np = _data(33, k, n)
    model(torch.from_numpy(x_np).requires_grad_()).backward(torch.from_numpy(gy_np))
    (_, w_fwd), (_, w_bwd), _ = seen  # forward X W^T, dgrad dY W (W^T as (K, N)), wgrad
    assert torch.equal(w_bwd.codes, w_fwd.codes.t()) and torch.equal(w_bwd.scale_inv, w_fwd.scale_inv.t())
    assert (w_bwd.tensor_scale is None) == (w_fwd.tensor_scale is None)
    if w_fwd.tensor_scale is not None:
        assert torch.equal(w_bwd.tensor_scale, w_fwd.tensor_scale)
    tile = (16, 16) if name == "nvfp4" else (128, 128)
    if name == "nvfp4":
        want = quantize_nvfp4_2d(layer.weight.detach().numpy(), tile)
        assert np.array_equal(w_fwd.codes.numpy(), want.codes)
        assert np.array_equal(w_fwd.scale_inv.numpy(), want.block_scale)
    else:
        want = quantize_scaled(layer.weight.detach().numpy(), "e4m3", "block:128x128", pow2=True)
        assert np.array_equal(w_fwd.codes.numpy(), want.codes)
        assert np.array_equal(w_fwd.scale_inv.numpy(), want.scale_inv)


def test_stochastic_rounding_changes_gradients_and_is_seeded():
    m, k, n = 32, 32, 16
    x_np, gy_np = _data(m, k, n, seed=3)

    def run(name, step):
        model, layer = _layer(get_recipe(name), k, n)
        st = get_fp8_state(model)
        st.step = step
        seen = _record_gemms(st)
        x = torch.from_numpy(x_np).requires_grad_()
        y = model(x)
        y.backward(torch.from_numpy(gy_np))
        return y.detach(), x.grad, layer.weight.grad, seen, st

    y_sr, dx_sr, dw_sr, seen, st = run("nvfp4", 5)
    y_rne, dx_rne, dw_rne, _, _ = run("nvfp4-no-sr", 5)
    assert torch.equal(y_sr, y_rne)  # the forward has no stochastic cast
    assert not torch.equal(dx_sr, dx_rne) and not torch.equal(dw_sr, dw_rne)
    again = run("nvfp4", 5)
    assert torch.equal(again[1], dx_sr) and torch.equal(again[2], dw_sr)  # same step: same bits
    later = run("nvfp4", 6)
    assert not torch.equal(later[1], dx_sr) and not torch.equal(later[2], dw_sr)
    # the dgrad operand is exactly fp8sim.nvfp4's stochastic cast with the state's seed
    gq = seen[1][0]
    want = quantize_nvfp4_2d(gy_np, (1, 16), rounding="stochastic", seed=st.seed_for("0.grad_output"))
    assert np.array_equal(gq.codes.numpy(), want.codes)
    assert np.array_equal(gq.scale_inv.numpy(), want.block_scale)
    # and each code is one of the two E2M1 neighbours of the scaled value (never further)
    rne = quantize_nvfp4_2d(gy_np, (1, 16))
    v_sr, v_rne = decode(want.codes, "e2m1"), decode(rne.codes, "e2m1")
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    step = np.abs(np.searchsorted(grid, np.abs(v_sr)) - np.searchsorted(grid, np.abs(v_rne)))
    assert step.max() <= 1 and (step == 1).any()


@pytest.mark.parametrize("backend", ["emulator", "torch"])
def test_te_block_scales_match_fp8sim_scaling(backend):
    """Every operand of the three GEMMs: 1x128 blocks along the reduction axis (the wgrad copies
    of X and dY along the tokens), 128x128 weight tiles; pow2 scales, E4M3 (Float8BlockScaling)."""
    m, k, n = 150, 200, 130
    model, layer = _layer(get_recipe("te-block"), k, n, backend)
    seen = _record_gemms(get_fp8_state(model))
    x_np, gy_np = _data(m, k, n, seed=5)
    x = torch.from_numpy(x_np).requires_grad_()
    model(x).backward(torch.from_numpy(gy_np))
    w_np = layer.weight.detach().numpy()

    def q(a, gran):
        return quantize_scaled(np.ascontiguousarray(a), "e4m3", gran, pow2=True)

    wants = [(q(x_np, "block:1x128"), q(w_np, "block:128x128")),  # forward: X (M, K), W (N, K)
             (q(gy_np, "block:1x128"), None),  # dgrad: dY (M, N), W^T (K, N)
             (q(gy_np.T, "block:1x128"), q(x_np.T, "block:1x128"))]  # wgrad: dY^T (N, M), X^T (K, M)
    assert len(seen) == 3
    for (a, b), (wa, wb) in zip(seen, wants):
        for op, want in ((a, wa), (b, wb)):
            if want is None:  # dgrad's W^T: a square tile's transpose is the cast of the transpose
                want = q(w_np.T, "block:128x128")
            assert np.array_equal(op.codes.numpy(), want.codes)
            assert np.array_equal(op.scale_inv.numpy(), want.scale_inv)
            assert np.all(np.log2(op.scale_inv.numpy()) % 1 == 0)  # powers of two
    # the GEMMs: float32 mm of the dequantized operands (exact with pow2 scales)
    xv, wv = q(x_np, "block:1x128").dequantize(), q(w_np, "block:128x128").dequantize()
    y_ref = torch.mm(torch.from_numpy(xv), torch.from_numpy(wv).t()) + layer.bias.detach()
    assert torch.equal(model(torch.from_numpy(x_np)).detach(), y_ref)


@pytest.mark.parametrize("other", ["torch", "triton"])
def test_te_block_other_backends_match_emulator(other):
    if other == "triton":
        pytest.importorskip("triton")
        from fp8sim.kernels.cast import is_interpreter

        if not is_interpreter():
            pytest.skip("CPU tensors need Triton's interpreter")
    m, k, n = (70, 130, 40) if other == "torch" else (20, 40, 24)  # the interpreter is slow
    x_np, gy_np = _data(m, k, n, seed=7)
    outs = []
    for backend in ("emulator", other):
        model, layer = _layer(get_recipe("te-block"), k, n, backend)
        x = torch.from_numpy(x_np).requires_grad_()
        y = model(x)
        y.backward(torch.from_numpy(gy_np))
        outs.append((y.detach(), x.grad, layer.weight.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", ["nvfp4", "nvfp4-no-rht"])
def test_nvfp4_on_triton_matches_the_emulator(recipe):
    """The triton backend's NVFP4 quantize and RHT kernels in the recipe: forward, input and
    weight gradients bit for bit the emulator's (stochastic rounding and the RHT included)."""
    pytest.importorskip("triton")
    from fp8sim.kernels.cast import is_interpreter

    if not is_interpreter():
        pytest.skip("CPU tensors need Triton's interpreter")
    m, k, n = 20, 48, 32  # 20 tokens: the RHT pads them to 32
    x_np, gy_np = _data(m, k, n, seed=11)
    outs = []
    for backend in ("emulator", "triton"):
        model, layer = _layer(get_recipe(recipe), k, n, backend)
        x = torch.from_numpy(x_np).requires_grad_()
        y = model(x)
        y.backward(torch.from_numpy(gy_np))
        outs.append((y.detach(), x.grad, layer.weight.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["torch"])
def test_nvfp4_refused_clearly_where_the_backend_cannot(backend):
    model = nn.Sequential(nn.Linear(32, 16))
    with pytest.raises(NotImplementedError, match=rf"recipe nvfp4: activation granularity nvfp4 .* backend {backend}"):
        convert_to_fp8(model, "nvfp4", backend)
    assert type(model[0]) is nn.Linear  # nothing converted


def test_layers_kept_in_high_precision_stay_nn_linear():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=3, n_head=2, n_embd=32))
    before = {name: (type(m), m.weight) for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    convert_to_fp8(model, get_recipe("nvfp4", keep_last_blocks=1), "emulator")
    for name, mod in model.named_modules():
        if name not in before:
            continue
        kept = name == "lm_head" or name.startswith("blocks.2.")
        if kept:  # untouched: the very module object's class and Parameter
            assert type(mod) is nn.Linear and mod.weight is before[name][1], name
        else:
            assert isinstance(mod, Fp8Linear) and mod.weight is before[name][1], name
    # the default keeps only lm_head (the last linear layer), as every fp8sim recipe
    model2 = GPT(GPTConfig(block_size=16, n_layer=3, n_head=2, n_embd=32))
    convert_to_fp8(model2, "nvfp4", "emulator")
    assert {n for n, m in model2.named_modules() if type(m) is nn.Linear} == {"lm_head"}
    x = torch.randint(0, 256, (2, 16))
    _, loss = model(x, x)
    loss.backward()
    assert torch.isfinite(loss)

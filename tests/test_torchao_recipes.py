"""torchao's float8 training, bit for bit: the recipes ``torchao-tensorwise``, ``-rowwise`` and
``-rowwise-gw-hp`` against vectors made by torchao 0.18 itself (``Float8LinearConfig`` with
``emulate=True``; tests/vectors/make_torchao_vectors.py, run in a scratch environment with
torchao installed): the scale rule on 504 crafted amaxes, the casts and GEMMs of one layer, and
the loss, logits, every gradient and every parameter of a tiny Llama over 3 AdamW steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fp8sim import backends
from fp8sim.formats import get_format
from fp8sim.granularity import Granularity
from fp8sim.policies import build_policy
from fp8sim.quantizer import Quantizer
from fp8sim.recipes import CastConfig, GemmRule, get_recipe
from fp8sim.scaling_config import TorchaoScalingConfig
from fp8sim.scaling_torch import torchao_scale

VECTORS = Path(__file__).parent / "vectors" / "torchao_float8_reference.safetensors"
#: the end-to-end vectors hold torch's CPU reductions, whose bits depend on the capability its
#: kernels run with (make_torchao_vectors.py): one file per capability, made by the same script
VECTORS_BY_CAPABILITY = {"AVX512": VECTORS,
                         "AVX2": VECTORS.with_name("torchao_float8_reference_avx2.safetensors")}  # fmt: skip
RECIPES = {"tensorwise": "torchao-tensorwise", "rowwise": "torchao-rowwise",
           "rowwise_with_gw_hp": "torchao-rowwise-gw-hp"}
PROBE = "model.layers.0.self_attn.k_proj"


def _read(path: Path) -> tuple[dict, dict]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["reference"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return meta, tensors


@pytest.fixture(scope="module")
def ref():
    return _read(VECTORS)


@pytest.fixture(scope="module")
def ref_here():
    """The vectors made with this machine's torch CPU capability (skip if none were)."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap not in VECTORS_BY_CAPABILITY:
        pytest.skip(f"no torchao vectors for torch's CPU capability {cap} (made for: "
                    f"{', '.join(VECTORS_BY_CAPABILITY)})")
    meta, t = _read(VECTORS_BY_CAPABILITY[cap])
    assert f"torch cpu capability {cap};" in meta["cpu"]  # the file is what its name says
    return meta, t


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t


def assert_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(_bits(got), _bits(want)), (
        f"{what}: {int((_bits(got) != _bits(want)).sum())} of {want.numel()} differ")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
def test_scale_rule_equals_torchaos_amax_to_scale(ref, fmt, pow2):
    _, t = ref
    want = t[f"scale_rule/{fmt}/{'pow2' if pow2 else 'plain'}/scale"]
    assert_bits(torchao_scale(t["scale_rule/amax"], fmt, pow2=pow2), want, "scale")
    # the policy object (replay, analysis) gives the same numbers one amax at a time
    pol = build_policy(TorchaoScalingConfig(pow2=pow2))
    some = t["scale_rule/amax"][::37]
    got = torch.tensor([pol.scale_for("x", fmt, current_amax=float(a)) for a in some], dtype=torch.float32)
    assert_bits(got, want[::37], "policy scale")


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_one_layers_casts_and_gemms_equal_torchaos(ref, recipe):
    """Forward GEMM, dX and dW of the probe layer at step 1: each operand's codes and scales as
    torchao held them, and each emulated GEMM's output."""
    _, t = ref
    p = f"{recipe}/{PROBE}"
    x, w, g = t[f"{p}/input"], t[f"{p}/weight"], t[f"{p}/grad_output"]
    lin = get_recipe(RECIPES[recipe]).linear
    be = backends.get("emulator")
    q = {role: Quantizer(c, be) for role, c in lin.casts().items()}
    wd = Quantizer(lin.weight_dgrad, be) if lin.weight_dgrad is not None else q["weight"]
    # operands as fp8sim lays them out (K last), and torchao's view of each (codes, scale)
    # fp8sim computes A B^T with both operands K-last; torchao's mm(a, b) holds b as our B^T
    gemms = {"output": ((q["activation"], x), (q["weight"], w)),
             "grad_input": ((q["grad_output"], g), (wd, w.t().contiguous()))}
    if lin.gemms.wgrad:
        gemms["grad_weight"] = ((q["grad_output"], g.t().contiguous()), (q["activation"], x.t().contiguous()))
    for name, ((qa, a), (qb, b)) in gemms.items():
        ca, cb = qa.quantize("a", a, observe=False), qb.quantize("b", b, observe=False)
        assert_bits(ca.codes, t[f"{p}/{name}/a_codes"], f"{name} a codes")
        assert_bits(ca.scale.expand_as(t[f"{p}/{name}/a_scale"]), t[f"{p}/{name}/a_scale"], f"{name} a scale")
        assert_bits(cb.codes.t().contiguous(), t[f"{p}/{name}/b_codes"], f"{name} b codes")
        want = t[f"{p}/{name}/b_scale"]
        assert_bits((cb.scale.t() if cb.scale.dim() else cb.scale).expand_as(want), want, f"{name} b scale")
        out = be.gemm(ca, cb, GemmRule.TORCHAO)
        assert_bits(out, t[f"{p}/{name}/out"], f"{name} output")
    if not lin.gemms.wgrad:
        assert_bits(g.t() @ x, t[f"{p}/grad_weight/out"], "high-precision dW")


def _llama(meta: dict, init: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**meta["llama_config"])
    config._attn_implementation = meta["attn_implementation"]
    model = LlamaForCausalLM(config).float()
    model.load_state_dict(init, strict=True)
    return model.train()


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_tiny_llama_trains_as_torchao_does_bit_for_bit(ref_here, recipe):
    meta, t = ref_here
    from fp8sim.training import convert_to_fp8

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the vectors were made: one fixed summation order per reduction
    try:
        init = {k[len("init/"):]: v for k, v in t.items() if k.startswith("init/")}
        model = _llama(meta, init)
        convert_to_fp8(model, get_recipe(RECIPES[recipe]), backend="emulator",
                       module_filter_fn=lambda mod, fqn: fqn != "lm_head")
        converted = [n for n, m in model.named_modules() if type(m).__name__ == "Fp8Linear"]
        assert converted == meta["converted_modules"]
        opt = torch.optim.AdamW(model.parameters(), **{k: tuple(v) if k == "betas" else v
                                                       for k, v in meta["adamw"].items()})
        for step in (1, 2, 3):
            opt.zero_grad(set_to_none=True)
            ids = t["batches"][step - 1]
            res = model(input_ids=ids, labels=ids)
            res.loss.backward()
            s = f"{recipe}/step{step}"
            assert_bits(res.loss.detach(), t[f"{s}/loss"], f"{s} loss")
            assert_bits(res.logits.detach(), t[f"{s}/logits"], f"{s} logits")
            for name, prm in model.named_parameters():
                assert_bits(prm.grad, t[f"{s}/grad/{name}"], f"{s} grad {name}")
            opt.step()
            for name, prm in model.named_parameters():
                assert_bits(prm.detach(), t[f"{s}/param/{name}"], f"{s} param {name}")
        assert not torch.equal(t[f"{recipe}/step3/loss"], t["fp32/step3/loss"])  # FP8 changed the numbers
    finally:
        torch.set_num_threads(threads)


def test_torchao_recipes_are_torchaos_configs():
    e4m3, e5m2 = get_format("e4m3"), get_format("e5m2")
    tw = get_recipe("torchao-tensorwise").linear
    assert (tw.input.fmt, tw.weight.fmt, tw.grad_output.fmt) == (e4m3, e4m3, e5m2)
    assert tw.input.scaling == TorchaoScalingConfig(pow2=False) and tw.gemm_rule is GemmRule.TORCHAO
    rw = get_recipe("torchao-rowwise").linear
    assert rw.grad_output == CastConfig(e4m3, TorchaoScalingConfig(pow2=True), Granularity.row())
    hp = get_recipe("torchao-rowwise-gw-hp").linear
    assert hp.weight_dgrad == CastConfig(e4m3, TorchaoScalingConfig(pow2=True)) and not hp.gemms.wgrad


def test_the_float64_accumulation_of_the_exact_rule_is_refused_for_torchaos_gemm():
    from torch import nn

    from fp8sim.training import convert_to_fp8

    with pytest.raises(ValueError, match="float64' is the exact GEMM rule's; .* torchao rule"):
        convert_to_fp8(nn.Sequential(nn.Linear(32, 16)), "torchao-tensorwise", gemm_accumulate="float64")

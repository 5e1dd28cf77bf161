"""Write tests/vectors/torchao_float8_reference.safetensors: torchao's float8 training, emulated.

A tiny Llama (transformers' ``LlamaForCausalLM`` from a ``LlamaConfig``, float32) trains 3 AdamW
steps with its linear layers converted by ``torchao.float8.convert_to_float8_training`` for each of
torchao's recipes ``tensorwise``, ``rowwise`` and ``rowwise_with_gw_hp``
(``Float8LinearConfig.from_recipe_name(name)`` with ``emulate=True``: the FP8 GEMMs run as float32
matmuls of the dequantized operands, on the CPU). ``lm_head`` stays in high precision; the 14
converted modules are ``model.layers.{0,1}.self_attn.{q,k,v,o}_proj`` and
``model.layers.{0,1}.mlp.{gate,up,down}_proj`` (``converted_modules`` in the metadata).

torchao and transformers' versions are pinned here, not in fp8sim's test extra, so their outputs
are committed with this script. Run it in a scratch environment::

    python3 -m venv /work/scratch-torchao && . /work/scratch-torchao/bin/activate
    pip install torch==2.13.0 && pip install torchao==0.18.0 transformers safetensors numpy
    python tests/vectors/make_torchao_vectors.py           # writes the file, prints a summary
    python tests/vectors/make_torchao_vectors.py --check   # two fresh runs: same bytes as the file
    # on a machine whose torch runs AVX2 (the end-to-end test picks the file of its capability):
    python tests/vectors/make_torchao_vectors.py --out tests/vectors/torchao_float8_reference_avx2.safetensors

Reproducibility: one CPU thread (``torch.set_num_threads(1)``, so each CPU GEMM and reduction
sums in one fixed order), deterministic algorithms, the single-tensor AdamW (``foreach=False,
fused=False``), fixed seeds. The bits depend on torch's CPU capability (its vectorized
reductions: ``ATEN_CPU_CAPABILITY=avx2`` instead of AVX512 changed 192 of the 634 tensors, while
``MKL_ENABLE_INSTRUCTIONS=AVX2`` changed none); the metadata records it.

Contents (float32 unless said; ``R`` is a recipe name, ``k`` = 1, 2, 3):

* ``init/<param>``: the state dict before step 1 (every parameter; the model has no buffers in
  its state dict). Load it instead of reproducing transformers' initialisation.
* ``batches``: int64 ``(3, B, T)`` token ids; step k trains on ``batches[k-1]`` with
  ``labels = input_ids`` (transformers shifts them inside the loss).
* ``R/step<k>/loss`` (0-d), ``R/step<k>/logits`` ``(B, T, vocab)``, ``R/step<k>/grad/<param>``
  (after ``loss.backward()``), ``R/step<k>/param/<param>`` (after ``optimizer.step()``).
* ``fp32/step<k>/loss`` and ``fp32/step1/logits``: the same run unconverted (high precision),
  to show that the recipes' numbers differ from it and from each other.
* ``R/model.layers.0.self_attn.k_proj/...`` (the probe: not square, with a bias), step 1, to
  localize a mismatch. ``input`` ``(M, K)``, ``weight`` ``(N, K)``, ``grad_output`` ``(M, N)``:
  the high-precision tensors (M = B*T, N = 16, K = 32). For each of torchao's float8 GEMMs ``G``
  in ``output`` (input @ weight.t()), ``grad_input`` (grad_output @ weight) and ``grad_weight``
  (grad_output.t() @ input): ``G/a_codes``, ``G/b_codes`` (uint8 views of the float8 operands as
  torchao holds them, made contiguous), ``G/a_scale``, ``G/b_scale`` (torchao's scales, shapes as
  it holds them: ``codes = fp8(clamp(x * scale))``, value ``= codes / scale``) and ``G/out`` (the
  emulated GEMM, ``torch.mm(a_codes.float() / a_scale, b_codes.float() / b_scale)``). The
  metadata entry ``R/<probe>/gemms`` gives each operand's float8 dtype, shape, stride (the layout
  torch.mm saw) and scale shape. ``rowwise_with_gw_hp`` runs its grad_weight GEMM in high
  precision: ``grad_weight/out`` is then the parameter's gradient ``grad_output.t() @ input``.
* ``scale_rule/amax`` (504 crafted float32 amaxes, :func:`crafted_amaxes`) and
  ``scale_rule/<e4m3|e5m2>/<plain|pow2>/scale``: torchao's ``amax_to_scale`` on them (its EPS
  clamp, inf and NaN amaxes, and power-of-two rounding, which takes scales a few ulps below 2**k
  up to 2**k). ``cast_rule/x`` (32, 16) and ``cast_rule/<case>/codes`` (uint8), ``/scale``:
  torchao's dynamic cast of it rowwise in E4M3 with pow2 (rows whose scale rounded up saturate)
  and tensorwise in E5M2.

Before writing, :func:`check_rules` recomputes every probed scale, code and GEMM output and both
tables with the rules written out there (not torchao's functions); every bit must match.
The file's metadata is one entry, ``reference``: sorted JSON with the versions, the CPU (torch's
CPU capability changes the bits of its vectorized reductions), the Llama config, the AdamW
settings, the converted modules, each recipe's resolved config and the probe's GEMM layouts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import subprocess
import sys
import tempfile
import warnings
from dataclasses import replace
from pathlib import Path

import torch

OUT = Path(__file__).with_name("torchao_float8_reference.safetensors")
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's Float8LinearRecipeName values
STEPS = 3
BATCH, SEQ = 2, 16
SEED = 2813
LLAMA = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
         "max_position_embeddings": 64, "attention_bias": True, "mlp_bias": False,
         "tie_word_embeddings": False, "rms_norm_eps": 1e-6}
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
         "foreach": False, "fused": False, "maximize": False, "capturable": False,
         "differentiable": False}
PROBE = "model.layers.0.self_attn.k_proj"  # not square (N 16, K 32), with a bias


def keep_high_precision(module: torch.nn.Module, fqn: str) -> bool:
    """torchao's module_filter_fn: convert every Linear except lm_head."""
    return fqn != "lm_head"


def build_model(init: dict[str, torch.Tensor] | None):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**LLAMA)
    config._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).float()
    if init is None:
        # transformers initialises biases to 0; random ones make the bias order matter at step 1
        with torch.no_grad():
            gen = torch.Generator().manual_seed(SEED + 1)
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    else:
        model.load_state_dict(init, strict=True)
    model.train()
    return model, config


def token_batches() -> torch.Tensor:
    gen = torch.Generator().manual_seed(SEED + 2)
    return torch.randint(0, LLAMA["vocab_size"], (STEPS, BATCH, SEQ), generator=gen, dtype=torch.int64)


#: torchao's operand roles (a, b) of each float8 GEMM of a Linear
GEMM_OF_ROLES = {("input", "weight"): "output", ("grad_output", "weight"): "grad_input",
                 ("grad_output", "input"): "grad_weight"}


class GemmProbe:
    """Records torchao's float8 GEMMs of one Float8Linear (found by its linear_mm_config object,
    which every Float8TrainingTensor of that layer carries) by wrapping torchao's aten.mm handler."""

    def __init__(self, module):
        from torchao.float8 import float8_ops

        self.table, self.module = float8_ops.FLOAT8_OPS_TABLE, module
        self.mm = self.table[torch.ops.aten.mm.default]
        self.active, self.tensors, self.layout = False, {}, {}
        self.table[torch.ops.aten.mm.default] = self._mm
        module.register_forward_pre_hook(self._pre)
        module.register_forward_hook(self._post)

    def _mm(self, aten_op, args, kwargs=None):
        out = self.mm(aten_op, args, kwargs)
        a, b = args[0], args[1]
        if self.active and a._linear_mm_config is self.module.linear_mm_config:
            gemm = GEMM_OF_ROLES[(a._gemm_input_role.value, b._gemm_input_role.value)]
            for side, t in (("a", a), ("b", b)):
                self.tensors[f"{gemm}/{side}_codes"] = t._data.view(torch.uint8).contiguous()
                self.tensors[f"{gemm}/{side}_scale"] = t._scale.detach().clone()
                self.layout[f"{gemm}/{side}"] = {"dtype": str(t._data.dtype), "shape": list(t._data.shape),
                                                 "stride": list(t._data.stride()),
                                                 "scale_shape": list(t._scale.shape)}
            self.tensors[f"{gemm}/out"] = out.detach().clone()
        return out

    def _pre(self, module, args):
        if self.active:
            self.tensors["input"] = args[0].detach().reshape(-1, args[0].shape[-1]).clone()
            self.tensors["weight"] = module.weight.detach().clone()

    def _post(self, module, args, output):
        if self.active:
            output.register_hook(self._grad_output)

    def _grad_output(self, g):
        self.tensors["grad_output"] = g.detach().reshape(-1, g.shape[-1]).clone()

    def close(self):
        self.table[torch.ops.aten.mm.default] = self.mm


def train(recipe: str | None, init, batches, out: dict, meta: dict) -> None:
    """Three AdamW steps of the model converted with ``recipe`` (None: unconverted, float32)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    model, _ = build_model(init)
    probe = None
    prefix = recipe or "fp32"
    if recipe is not None:
        config = replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
        convert_to_float8_training(model, config=config, module_filter_fn=keep_high_precision)
        converted = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
        meta.setdefault("converted_modules", converted)
        assert meta["converted_modules"] == converted
        meta[f"{recipe}/config"] = repr(config)
        probe = GemmProbe(model.get_submodule(PROBE))
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    for step in range(1, STEPS + 1):
        if probe is not None:
            probe.active = step == 1
        opt.zero_grad(set_to_none=True)
        ids = batches[step - 1]
        res = model(input_ids=ids, labels=ids)
        res.loss.backward()
        out[f"{prefix}/step{step}/loss"] = res.loss.detach().clone()
        if recipe is not None or step == 1:
            out[f"{prefix}/step{step}/logits"] = res.logits.detach().clone()
        if recipe is not None:
            for name, p in model.named_parameters():
                out[f"{prefix}/step{step}/grad/{name}"] = p.grad.detach().clone()
        opt.step()
        if recipe is not None:
            for name, p in model.named_parameters():
                out[f"{prefix}/step{step}/param/{name}"] = p.detach().clone()
        if probe is not None and step == 1:
            probe.active = False
            if "grad_weight/out" not in probe.tensors:  # high-precision grad_weight GEMM
                probe.tensors["grad_weight/out"] = model.get_submodule(PROBE).weight.grad.detach().clone()
            for k, v in probe.tensors.items():
                out[f"{recipe}/{PROBE}/{k}"] = v
            meta[f"{recipe}/{PROBE}/gemms"] = probe.layout
    if probe is not None:
        probe.close()


def generate() -> tuple[dict[str, torch.Tensor], dict]:
    import numpy
    import safetensors
    import torchao
    import transformers

    torch.set_num_threads(1)  # one fixed summation order for every CPU GEMM and reduction
    torch.use_deterministic_algorithms(True)
    model, config = build_model(None)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    del model
    batches = token_batches()
    out: dict[str, torch.Tensor] = {f"init/{k}": v for k, v in init.items()}
    out["batches"] = batches
    meta: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scale_rule_vectors(out)
        train(None, init, batches, out, meta)
        for recipe in RECIPES:
            train(recipe, init, batches, out, meta)
    meta.update({
        "versions": f"torch {torch.__version__}; torchao {torchao.__version__}; transformers "
                    f"{transformers.__version__}; safetensors {safetensors.__version__}; numpy "
                    f"{numpy.__version__}; python {platform.python_version()}",
        "cpu": f"{platform.machine()} {_cpu_model()}; torch cpu capability "
               f"{torch.backends.cpu.get_cpu_capability()}; torch.get_num_threads() {torch.get_num_threads()}",
        "llama_config": config.to_diff_dict(),
        "attn_implementation": "eager",
        "adamw": ADAMW,
        "train": f"{STEPS} steps; step k: zero_grad(set_to_none=True), loss = model(input_ids="
                 f"batches[k-1], labels=batches[k-1]).loss, loss.backward(), record loss, logits and "
                 f"grads, optimizer.step(), record params; model.train(); seed {SEED}",
        "recipes": "torchao Float8LinearConfig.from_recipe_name(R) with emulate=True "
                   "(dataclasses.replace); module_filter_fn keeps lm_head in high precision",
        "python_warnings": sorted({f"{w.category.__name__}: {w.message}" for w in caught}),
    })
    return {k: v.contiguous() for k, v in out.items()}, meta


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def crafted_amaxes() -> torch.Tensor:
    """float32 amaxes for the scale rule: for each format and several k, the amax whose scale is
    exactly 2**k and the 24 float32 amaxes above it (scales a few ulps below 2**k, where torchao's
    power-of-two rounding goes up to 2**k, not down); 96 log-uniform positive floats; 0, the
    smallest subnormal, float32(1e-12) and its neighbours, float32 max, inf and NaN."""
    vals = []
    for fmax in (448.0, 57344.0):
        for k in (-20, -3, 0, 3, 4, 10, 17, 33):
            a = torch.tensor(fmax * 2.0**-k, dtype=torch.float32)
            for _ in range(25):
                vals.append(a)
                a = torch.nextafter(a, torch.tensor(float("inf")))
    gen = torch.Generator().manual_seed(SEED + 3)
    vals.extend(torch.exp2(torch.rand(96, generator=gen, dtype=torch.float64) * 276 - 149).float())
    eps = torch.tensor(1e-12, dtype=torch.float32)
    vals.extend([torch.tensor(0.0), torch.tensor(2.0**-149), eps, torch.nextafter(eps, torch.tensor(0.0)),
                 torch.nextafter(eps, torch.tensor(1.0)), torch.tensor(torch.finfo(torch.float32).max),
                 torch.tensor(float("inf")), torch.tensor(float("nan"))])
    return torch.stack(vals).float()


def scale_rule_vectors(out: dict) -> None:
    """torchao's own amax -> scale (``amax_to_scale``) on :func:`crafted_amaxes`, each format,
    power-of-two rounding off and on; and its dynamic cast (``hp_tensor_to_float8_dynamic``) of a
    (32, 16) tensor whose row amaxes are 448 / 2**20 and the 31 float32s above it, so the first
    row scales round up to 2**20 and those rows' largest values saturate (rowwise, e4m3, pow2),
    and of the same tensor tensorwise in e5m2."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.float8_utils import amax_to_scale

    amax = crafted_amaxes()
    out["scale_rule/amax"] = amax
    for fmt, dtype in FORMATS.items():
        for pow2 in (False, True):
            out[f"scale_rule/{fmt}/{'pow2' if pow2 else 'plain'}/scale"] = amax_to_scale(amax, dtype, pow2)
    gen = torch.Generator().manual_seed(SEED + 4)
    row_amax = [torch.tensor(448 * 2.0**-20)]  # scale 2**20; the next 31 float32s above it
    for _ in range(31):
        row_amax.append(torch.nextafter(row_amax[-1], torch.tensor(1.0)))
    row_amax = torch.stack(row_amax)
    x = (torch.rand(32, 16, generator=gen) * 2 - 1) * row_amax[:, None]
    x[:, 3], x[:, 7] = row_amax, -row_amax
    out["cast_rule/x"] = x
    for key, dtype, gran, dim, pow2 in (
            ("e4m3_rowwise_pow2", FORMATS["e4m3"], ScalingGranularity.AXISWISE, -1, True),
            ("e5m2_tensorwise", FORMATS["e5m2"], ScalingGranularity.TENSORWISE, None, False)):
        t = hp_tensor_to_float8_dynamic(x, dtype, LinearMMConfig(), scaling_granularity=gran,
                                        axiswise_dim=dim, round_scales_to_power_of_2=pow2)
        out[f"cast_rule/{key}/codes"] = t._data.view(torch.uint8)
        out[f"cast_rule/{key}/scale"] = t._scale


def rule_scale(amax: torch.Tensor, dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """torchao 0.18's scale, as written in the notes: float32(float64(fmt max) / max(float64(amax),
    1e-12)); pow2: exp2(floor(log2(scale))) on the float32 scale with torch.log2 (which rounds
    scales a few ulps below 2**k up to 2**k)."""
    fmax = torch.finfo(dtype).max
    scale = (fmax / amax.double().clamp(min=1e-12)).float()
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


def rule_cast(x: torch.Tensor, dtype: torch.dtype, dim: int | None, pow2: bool):
    """amax = max |x| in float32 (over the tensor, or along ``dim`` kept as size 1), then
    codes = fp8(clamp(float32(x * scale), -max, max)) with torch's round-to-nearest-even cast."""
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    scale = rule_scale(amax, dtype, pow2)
    fmax = torch.finfo(dtype).max
    return (x * scale).clamp(-fmax, fmax).to(dtype), scale


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def check_rules(out: dict[str, torch.Tensor]) -> None:
    """Recompute torchao's scales, codes and GEMM outputs with :func:`rule_scale` and
    :func:`rule_cast` (the rules of the notes, not torchao's functions); every bit must match:
    the scale table, the cast case, and the probe's three GEMMs per recipe from its
    high-precision tensors (GEMM = torch.mm of codes.float() / scale, float32)."""
    amax = out["scale_rule/amax"]
    for fmt, dtype in FORMATS.items():
        for pow2 in (False, True):
            ref = out[f"scale_rule/{fmt}/{'pow2' if pow2 else 'plain'}/scale"]
            assert _same_bits(rule_scale(amax, dtype, pow2), ref), (fmt, pow2)
    x = out["cast_rule/x"]
    for key, dtype, dim, pow2 in (("e4m3_rowwise_pow2", FORMATS["e4m3"], -1, True),
                                  ("e5m2_tensorwise", FORMATS["e5m2"], None, False)):
        codes, scale = rule_cast(x, dtype, dim, pow2)
        assert _same_bits(codes.view(torch.uint8), out[f"cast_rule/{key}/codes"]), key
        assert _same_bits(scale, out[f"cast_rule/{key}/scale"]), key
    e4, e5 = FORMATS["e4m3"], FORMATS["e5m2"]
    # per recipe: pow2, and per GEMM its operands a, b as (x: input (M, K), wt: weight.t() (K, N),
    # go: grad_output (M, N); format; amax axis, None for one scale; transposed after the cast)
    plans = {
        "tensorwise": (False, {"output": (("x", e4, None, False), ("wt", e4, None, False)),
                               "grad_input": (("go", e5, None, False), ("wt", e4, None, True)),
                               "grad_weight": (("go", e5, None, True), ("x", e4, None, False))}),
        "rowwise": (True, {"output": (("x", e4, -1, False), ("wt", e4, 0, False)),
                           "grad_input": (("go", e4, -1, False), ("wt", e4, -1, True)),
                           "grad_weight": (("go", e4, 0, True), ("x", e4, 0, False))}),
        "rowwise_with_gw_hp": (True, {"output": (("x", e4, -1, False), ("wt", e4, 0, False)),
                                      "grad_input": (("go", e4, -1, False), ("wt", e4, None, True))}),
    }
    for recipe, (pow2, gemms) in plans.items():
        p = f"{recipe}/{PROBE}"
        hp = {"x": out[f"{p}/input"], "wt": out[f"{p}/weight"].t(), "go": out[f"{p}/grad_output"]}
        for gemm, operands in gemms.items():
            vals = []
            for side, (name, dtype, dim, transpose) in zip("ab", operands):
                codes, scale = rule_cast(hp[name], dtype, dim, pow2)
                if transpose:
                    codes, scale = codes.t(), (scale.t() if scale.ndim else scale)
                ref = out[f"{p}/{gemm}/{side}_codes"]
                assert _same_bits(codes.view(torch.uint8).contiguous(), ref), (p, gemm, side)
                assert _same_bits(scale, out[f"{p}/{gemm}/{side}_scale"]), (p, gemm, side)
                vals.append(codes.float() / scale)
            assert _same_bits(torch.mm(*vals), out[f"{p}/{gemm}/out"]), (p, gemm)
        if "grad_weight" not in gemms:  # high precision grad_weight
            assert _same_bits(torch.mm(hp["go"].t(), hp["x"]), out[f"{p}/grad_weight/out"]), p


def sanity(out: dict[str, torch.Tensor]) -> None:
    """The vectors discriminate: at step 1 every recipe's logits differ from fp32's and from each
    other's, except rowwise and rowwise_with_gw_hp, whose forward casts are the same (equal
    logits) and whose backward differs (different gradients); every number of the training runs
    is finite; the scale table holds scales that torchao's pow2 rounding took up, not down."""
    runs = ("fp32",) + RECIPES
    for i, a in enumerate(runs):
        for b in runs[:i]:
            same = torch.equal(out[f"{a}/step1/logits"], out[f"{b}/step1/logits"])
            assert same == ({a, b} == {"rowwise", "rowwise_with_gw_hp"}), (a, b, same)
    grads = [k.split("/", 1)[1] for k in out if k.startswith("rowwise/step1/grad/")]
    assert any(not torch.equal(out[f"rowwise/{g}"], out[f"rowwise_with_gw_hp/{g}"]) for g in grads)
    for k, v in out.items():
        if v.is_floating_point() and not k.startswith(("scale_rule/", "cast_rule/")):
            assert torch.isfinite(v).all(), f"{k} is not finite"
    plain, pow2 = out["scale_rule/e4m3/plain/scale"], out["scale_rule/e4m3/pow2/scale"]
    assert (pow2 > plain).any() and (pow2 < plain).any()
    up = out["cast_rule/e4m3_rowwise_pow2/scale"].reshape(-1) == 2.0**20
    assert up[1:].any() and not up.all()  # row 0's scale is exactly 2**20, rows 1.. rounded up


def summary(out: dict[str, torch.Tensor], meta: dict, path: Path) -> str:
    lines = [f"{path} ({path.stat().st_size} bytes, sha256 {sha256(path)})",
             f"  {meta['versions']}", f"  {meta['cpu']}",
             f"  converted: {', '.join(meta['converted_modules'])}"]
    for r in ("fp32",) + RECIPES:
        losses = " ".join(f"{out[f'{r}/step{k}/loss'].item():.6f}" for k in range(1, STEPS + 1))
        lines.append(f"  {r:20s} loss per step: {losses}")
    for r in RECIPES:
        s = {g: tuple(out[f"{r}/{PROBE}/{g}/a_scale"].shape) for g in ("output", "grad_input", "grad_weight")
             if f"{r}/{PROBE}/{g}/a_scale" in out}
        lines.append(f"  {r:20s} {PROBE} float8 GEMMs (a_scale shapes): {s}")
    return "\n".join(lines)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    out, meta = generate()
    check_rules(out)
    sanity(out)
    # one metadata entry: safetensors writes a metadata dict in a per-process random order
    save_file(out, str(path), metadata={"reference": json.dumps(meta, sort_keys=True, indent=1)})
    back = load_file(str(path))
    assert back.keys() == out.keys() and all(_same_bits(back[k], out[k]) for k in out)
    print(summary(out, meta, path), file=sys.stderr)


def check() -> int:
    """Two fresh processes write the file again; both must match each other and the committed one."""
    hashes = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(2):
            p = Path(tmp) / f"run{i}.safetensors"
            subprocess.run([sys.executable, __file__, "--out", str(p)], check=True)
            hashes.append(sha256(p))
    committed = sha256(OUT) if OUT.exists() else None
    print(f"fresh runs: {hashes[0]} {hashes[1]}; committed: {committed}", file=sys.stderr)
    return 0 if hashes[0] == hashes[1] == committed else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=OUT, help="where to write (default: %(default)s)")
    ap.add_argument("--check", action="store_true",
                    help="regenerate twice in fresh processes and compare with the committed file")
    args = ap.parse_args()
    if args.check:
        return check()
    write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Which of a model's GEMMs :func:`~fp8sim.training.convert.convert_to_fp8` runs in FP8, which it
keeps in high precision and why, and what it cannot convert.

* the **output layer** is found by what it is: ``get_output_embeddings()`` of every Hugging Face
  model in the tree (BERT's ``cls.predictions.decoder``, RoBERTa's ``lm_head.decoder``,
  DistilBERT's ``vocab_projector``, a causal LM's ``lm_head``) and every linear layer whose
  weight is an ``nn.Embedding``'s (tied embeddings);
* a **router** is a parameter-holding leaf module beside the experts in a mixture-of-experts
  block (the parent of a transformers experts module): Mixtral's ``gate``, GPT-OSS's
  ``router``, Qwen2-MoE's ``shared_expert_gate`` -- but not a shared expert, which holds linear
  layers;
* a module holding parameters of two or more dimensions that is none of an ``nn.Linear``, a
  Hugging Face ``Conv1D``, a transformers experts module, an embedding or a router (a
  convolution, ``nn.MultiheadAttention``'s packed projection, a custom MoE) is **not converted**:
  :func:`warn_not_converted` names them, with their parameter counts, in one warning.

:class:`Fp8Summary` (``get_fp8_state(model).summary``) reports it all, with the linear MACs per
token on each side.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch.nn as nn

from fp8sim.training.experts import experts_projections, is_fp8_experts, is_hf_experts
from fp8sim.training.fp8_linear import Fp8Linear, is_hf_conv1d

__all__ = ["Fp8Summary", "is_linear", "output_layers", "routers", "summarize", "warn_not_converted"]

#: why a GEMM layer stays in high precision
OUTPUT_LAYER, ROUTER, SKIP, FILTER, LAST_BLOCKS = ("output layer", "router", "recipe skip list", "module_filter_fn",
                                                   "keep_last_blocks")  # fmt: skip


def is_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` (subclasses too) or a Hugging Face ``Conv1D``."""
    return isinstance(module, nn.Linear) or is_hf_conv1d(module)


def output_layers(model: nn.Module) -> set[int]:
    """The ids of ``model``'s output layers: ``get_output_embeddings()`` of every Hugging Face
    model in it, and every linear layer whose weight is an ``nn.Embedding``'s weight."""
    out: set[int] = set()
    for mod in model.modules():
        get = getattr(mod, "get_output_embeddings", None)
        if callable(get) and type(mod).__module__.startswith("transformers."):
            head = get()
            if isinstance(head, nn.Module):
                out.add(id(head))
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    out.update(id(m) for m in model.modules() if is_linear(m) and id(m.weight) in tied)
    return out


def routers(model: nn.Module) -> dict[str, nn.Module]:
    """``{qualified name: module}`` of the routers (module docstring)."""
    out = {}
    for name, block in model.named_modules():
        children = dict(block.named_children())
        if not any(is_hf_experts(c) or is_fp8_experts(c) for c in children.values()):
            continue
        for child_name, child in children.items():
            if is_hf_experts(child) or is_fp8_experts(child):
                continue
            leaf = not any(True for c in child.children() for _ in c.parameters())
            if leaf and any(True for _ in child.parameters(recurse=False)):
                out[f"{name}.{child_name}" if name else child_name] = child
    return out


@dataclass
class Fp8Summary:
    """What a conversion runs in FP8 (``get_fp8_state(model).summary``).

    Attributes:
        fp8: parameter name (the layer's path: a tied weight is named after its layer) ->
            element count, for the weights whose GEMMs run in FP8 (FP8 linears' weights, FP8
            experts' 3-D weights).
        high_precision: parameter name -> (element count, reason), for the weights of GEMM
            layers kept in high precision: ``output layer``, ``router``, ``recipe skip list``,
            ``module_filter_fn``, ``keep_last_blocks``.
        not_converted: module name -> (class name, element count of its parameters), for the
            modules holding parameters fp8sim cannot convert (module docstring).
        macs_per_token: the multiply-accumulates of the linear layers per token through them
            (a linear's ``in x out``; experts' ``top_k / num_experts`` of their weights, top_k
            from the model config's ``num_experts_per_tok``): ``fp8``, ``high_precision`` (the
            other kept layers), ``output layer``, ``router``.
    """

    fp8: dict[str, int] = field(default_factory=dict)
    high_precision: dict[str, tuple[int, str]] = field(default_factory=dict)
    not_converted: dict[str, tuple[str, int]] = field(default_factory=dict)
    macs_per_token: dict[str, float] = field(default_factory=lambda: {
        "fp8": 0.0, "high_precision": 0.0, OUTPUT_LAYER: 0.0, ROUTER: 0.0})

    @property
    def fp8_share(self) -> float:
        """The FP8 share of the linear MACs per token, output layer and routers left out."""
        total = self.macs_per_token["fp8"] + self.macs_per_token["high_precision"]
        return self.macs_per_token["fp8"] / total if total else 0.0

    def __str__(self) -> str:
        m = self.macs_per_token
        lines = [f"FP8: {len(self.fp8)} weights, {sum(self.fp8.values()):,} parameters; linear MACs per token: "
                 f"FP8 {m['fp8']:,.0f} ({self.fp8_share:.1%} of those outside the output layer and routers), "
                 f"high precision {m['high_precision']:,.0f}, output layer {m[OUTPUT_LAYER]:,.0f}, "
                 f"routers {m[ROUTER]:,.0f}"]
        lines += [f"  high precision: {n} ({c:,} parameters, {why})" for n, (c, why) in self.high_precision.items()]
        lines += [f"  not converted: {n} ({cls}, {c:,} parameters)" for n, (cls, c) in self.not_converted.items()]
        return "\n".join(lines)


def _macs(module: nn.Module) -> dict[str, float]:
    """Parameter name (within ``module``) -> MACs per token of a linear or experts module."""
    if is_linear(module) or isinstance(module, Fp8Linear):
        return {"weight": float(module.weight.numel())}
    top_k = getattr(module.config, "num_experts_per_tok", None)
    share = (top_k or 0) / module.num_experts
    return {w: getattr(module, w).numel() * share for w, _ in experts_projections(module)}


def summarize(model: nn.Module, kept: dict[str, str]) -> Fp8Summary:
    """The summary of a converted ``model``; ``kept``: qualified name -> reason of the GEMM
    modules (linears, experts, routers) left in high precision."""
    s = Fp8Summary()
    seen: set[int] = set()

    def add(prefix: str, module: nn.Module, reason: str | None) -> None:
        for pname, macs in _macs(module).items():
            p = getattr(module, pname)
            if id(p) in seen:  # a tied weight counts once
                continue
            seen.add(id(p))
            name = f"{prefix}.{pname}"  # the layer's own path, also for a weight tied to another module
            if reason is None:
                s.fp8[name] = p.numel()
                s.macs_per_token["fp8"] += macs
            else:
                s.high_precision[name] = (p.numel(), reason)
                s.macs_per_token[reason if reason in (OUTPUT_LAYER, ROUTER) else "high_precision"] += macs

    for name, mod in model.named_modules():
        if isinstance(mod, Fp8Linear) or is_fp8_experts(mod):
            add(name, mod, None)
        elif name in kept and (is_linear(mod) or is_hf_experts(mod)):
            add(name, mod, kept[name])
        elif name in kept:  # a router that is no linear layer (its own weight, F.linear)
            for pname, p in mod.named_parameters(recurse=False):
                if id(p) not in seen and p.dim() >= 2:
                    seen.add(id(p))
                    s.high_precision[f"{name}.{pname}"] = (p.numel(), kept[name])
                    s.macs_per_token[ROUTER] += p.numel()
        elif not isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and not is_linear(mod):
            own = [p for p in mod.parameters(recurse=False) if p.dim() >= 2 and id(p) not in seen]
            if own:
                s.not_converted[name] = (type(mod).__name__, sum(p.numel() for p in own))
    return s


def warn_not_converted(summary: Fp8Summary) -> None:
    """One warning naming every module that holds parameters fp8sim cannot convert."""
    if summary.not_converted:
        items = "; ".join(f"{n} ({cls}, {c:,} parameters)" for n, (cls, c) in summary.not_converted.items())
        warnings.warn(f"convert_to_fp8: {len(summary.not_converted)} modules hold parameters it cannot convert "
                      f"(not an nn.Linear, Conv1D or transformers experts module; they stay in high precision): "
                      f"{items}", UserWarning, stacklevel=3)

"""Hugging Face's ``save_pretrained`` / ``from_pretrained`` with a converted model.

Every FP8 layer keeps its share of the FP8 state (its tensors' scaling-policy states and the
step) in ``state_dict()`` as a uint8 tensor of JSON (``..._extra_state``), so
``model.save_pretrained(dir)`` writes it into the safetensors files beside the weights.
(transformers 5 may write some models in their original checkpoint layout -- Mixtral's experts
as per-expert ``w1``/``w2``/``w3`` under ``block_sparse_moe`` -- and the FP8 entries' names follow
its renaming). ``from_pretrained`` builds the model before fp8sim converts it, so it loads the
weights and reports the FP8 entries as unused; :func:`load_fp8_state` then loads them, renamed
back as transformers renames the weights, into the converted model::

    model.save_pretrained("ckpt")                           # weights + FP8 state (safetensors)
    torch.save(optimizer.state_dict(), "ckpt/optimizer.pt")
    ...
    model = AutoModelForCausalLM.from_pretrained("ckpt").train()   # (it comes back in eval mode)
    convert_to_fp8(model, recipe)                           # as the saved model was converted
    load_fp8_state(model, "ckpt")                           # training continues bit for bit
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.nn as nn

__all__ = ["load_fp8_state"]

_SUFFIX = "._extra_state"


def _files(path: Path) -> list[Path]:
    """The safetensors files of a ``save_pretrained`` directory (one, or the shards its index
    names), or ``path`` itself if it is a file."""
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"load_fp8_state: {path} holds no model.safetensors (nor its sharded index)")


def _model_key(model: nn.Module, key: str) -> str:
    """A saved key as the model names it: transformers 5 saves some models in their original
    checkpoint layout (Mixtral's ``mlp`` as ``block_sparse_moe``) and renames the keys back on
    load (its weight conversion mapping); the FP8 entries are renamed the same way."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # no transformers, or one without conversion mappings: keys are as saved
        return key
    if not isinstance(model, PreTrainedModel):
        return key
    transforms = getattr(model, "_weight_conversions", None) or get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return rename_source_key(key, renamings, converters)[0]


def load_fp8_state(model: nn.Module, path: str | os.PathLike) -> None:
    """Load the FP8 state a converted model's ``save_pretrained`` wrote in ``path`` (its
    directory, or one ``.safetensors`` file) into ``model``, converted as the saved one was.

    Only the ``..._extra_state`` entries are read (safetensors: no code runs). ValueError when an
    FP8 layer of ``model`` finds no saved state (the save came from a model converted
    differently, or not at all) or a saved state has no FP8 layer here; the policy mismatch
    checks of the layers apply (a state saved under another recipe is refused)."""
    from safetensors import safe_open

    from fp8sim.training.convert import fp8_experts, fp8_linears

    saved = {}
    for f in _files(Path(path)):
        with safe_open(str(f), "pt") as st:
            saved.update({k: st.get_tensor(k) for k in st.keys() if k.endswith(_SUFFIX)})
    saved = {_model_key(model, k): v for k, v in saved.items()}
    fp8 = {id(m) for m in fp8_linears(model) + fp8_experts(model)}
    layers = {f"{name}{_SUFFIX}" for name, m in model.named_modules() if id(m) in fp8}
    if not layers:
        raise ValueError("load_fp8_state: model holds no FP8 layers; convert_to_fp8 it as the saved model was first")
    missing, extra = sorted(layers - set(saved)), sorted(set(saved) - layers)
    if missing or extra:
        what = (f"{len(missing)} FP8 layers have no saved state (first: {missing[0]})" if missing else
                f"{len(extra)} saved FP8 states have no FP8 layer here (first: {extra[0]})")
        raise ValueError(f"load_fp8_state: {path} was saved from a model converted differently: {what}")
    model.load_state_dict(saved, strict=False)

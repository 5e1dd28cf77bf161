"""Hugging Face's save_pretrained / from_pretrained (safetensors) of a converted model: the FP8
state travels in the safetensors files and training continues bit for bit."""

import copy

import pytest
import torch
from safetensors import safe_open

from fp8sim.training import convert_to_fp8, get_fp8_state, load_fp8_state
from fp8sim.training.fp8_state import decode_extra_state
from tests.test_byom_convert import tokens, transformers
from tests.test_byom_moe import _tiny_moe


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread(one_torch_thread):
    yield


def _steps(model, opt, first, last):
    """AdamW steps ``first..last``; their losses as float.hex."""
    out = []
    for step in range(first, last + 1):
        x = tokens(step, batch=2, seq=16)
        opt.zero_grad()
        loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        out.append(float(loss.detach()).hex())
    return out


def test_save_pretrained_and_from_pretrained_continue_training_bit_for_bit(tmp_path):
    tf = transformers()
    model = convert_to_fp8(_tiny_moe("mixtral"), "te-delayed")  # FP8 linears, FP8 experts, a kept head
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _steps(model, opt, 1, 3)
    model.save_pretrained(tmp_path)
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    at_save = copy.deepcopy(get_fp8_state(model).state_dict())
    full = _steps(model, opt, 4, 6)  # the uninterrupted run

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:  # Mixtral's original layout: block_sparse_moe
        extra = f.get_tensor("model.layers.0.block_sparse_moe.experts._extra_state")
        assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in f.keys()
    state = decode_extra_state(extra, "experts")
    assert state["step"] == 3 and "model.layers.0.mlp.experts.down_proj.1.grad_output" in \
        state["policies"]["grad_output"]["tensors"]  # fmt: skip

    loaded = tf.MixtralForCausalLM.from_pretrained(tmp_path).train()  # from_pretrained returns it in eval mode
    convert_to_fp8(loaded, "te-delayed")
    load_fp8_state(loaded, tmp_path)
    assert get_fp8_state(loaded).state_dict() == at_save
    opt2 = torch.optim.AdamW(loaded.parameters(), lr=1e-2)
    opt2.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
    assert _steps(loaded, opt2, 4, 6) == full
    assert get_fp8_state(loaded).state_dict() == get_fp8_state(model).state_dict()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))


def test_load_fp8_state_refuses_a_model_converted_otherwise(tmp_path):
    tf = transformers()
    model = convert_to_fp8(_tiny_moe("mixtral"), "te-delayed")
    model.save_pretrained(tmp_path)
    plain = tf.MixtralForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="holds no FP8 layers"):
        load_fp8_state(plain, tmp_path)
    partial = convert_to_fp8(tf.MixtralForCausalLM.from_pretrained(tmp_path), "te-delayed",
                             module_filter_fn=lambda m, fqn: "experts" not in fqn)
    with pytest.raises(ValueError, match=r"converted differently: 2 saved FP8 states have no FP8 layer here "
                                         r"\(first: model.layers.0.mlp.experts._extra_state\)"):
        load_fp8_state(partial, tmp_path)
    other = convert_to_fp8(tf.MixtralForCausalLM.from_pretrained(tmp_path), "te-current")
    with pytest.raises(ValueError, match="saved with policy"):
        load_fp8_state(other, tmp_path)
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_fp8_state(other, tmp_path / "nothing")

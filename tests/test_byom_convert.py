"""Bring your own model: convert_to_fp8 on Hugging Face models built from configs, and dtypes.

Also holds the tiny Hugging Face model builders the other test_byom_* files import.
"""


import pytest
import torch
import torch.nn as nn

from fp8sim.training import convert_to_fp8, get_fp8_state, get_recipe
from fp8sim.training.fp8_linear import Fp8Linear
from fp8sim.formats import get_format
from fp8sim.recipes import CastConfig, LinearRecipe


def transformers():
    """transformers, quiet (conftest has imported Hugging Face's ``kernels`` the way it must be
    from a checkout)."""
    import transformers as tf
    from transformers import GPT2LMHeadModel, LlamaForCausalLM  # noqa: F401  (import them now)
    from transformers.pytorch_utils import Conv1D  # noqa: F401

    tf.logging.set_verbosity_error()
    return tf


def tiny_llama(seed: int = 0, **overrides):
    tf = transformers()
    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    cfg.update(overrides)
    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**cfg))


def tiny_gpt2(seed: int = 0, **overrides):
    tf = transformers()
    cfg = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0,
               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg.update(overrides)
    torch.manual_seed(seed)
    return tf.GPT2LMHeadModel(tf.GPT2Config(**cfg))


def tokens(step: int, batch: int = 2, seq: int = 16, vocab: int = 128) -> torch.Tensor:
    """Random token ids of one step, from the step alone (a resumed run sees the same ones)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (batch, seq), generator=g)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


LLAMA_LINEARS = {f"model.layers.{i}.{s}" for i in range(2) for s in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
GPT2_CONV1DS = {f"transformer.h.{i}.{s}" for i in range(2) for s in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}


# -- 1. convert_to_fp8 ------------------------------------------------------------------------------


def test_llama_converts_every_projection_but_the_head_and_keeps_its_state_dict():
    model = tiny_llama()
    before = {k: (v.dtype, tuple(v.shape)) for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    convert_to_fp8(model, "te-delayed")  # a recipe name works as a Recipe does
    assert {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)} == LLAMA_LINEARS
    assert type(model.lm_head) is nn.Linear  # the recipe's skip list
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    after = {k: (v.dtype, tuple(v.shape)) for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert after == before
    loss = model(tokens(1), labels=tokens(1)).loss
    loss.backward()
    assert get_fp8_state(model).pop_events()["underflow"] > 0  # the casts ran (scale 1 at step 1)


def test_gpt2_conv1d_converts_with_its_transposed_weight_as_stored():
    model = tiny_gpt2()
    w = model.transformer.h[0].attn.c_attn.weight
    convert_to_fp8(model, get_recipe("te-current"))
    assert {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)} == GPT2_CONV1DS
    layer = model.transformer.h[0].attn.c_attn
    assert layer.weight is w and w.shape == (64, 192) and layer.transposed  # (in, out), untouched
    model(tokens(1), labels=tokens(1)).loss.backward()
    assert w.grad.shape == (64, 192)


def test_conv1d_layer_equals_the_linear_with_the_transposed_weight_bit_for_bit():
    from transformers.pytorch_utils import Conv1D

    transformers()
    torch.manual_seed(0)
    conv = Conv1D(48, 64)  # nf=48 outputs, nx=64 inputs; weight (64, 48)
    with torch.no_grad():
        conv.bias.normal_()
    lin = nn.Linear(64, 48)
    with torch.no_grad():
        lin.weight.copy_(conv.weight.t())
        lin.bias.copy_(conv.bias)
    a, b = nn.Sequential(conv), nn.Sequential(lin)
    recipe = LinearRecipe(CastConfig(get_format("e4m3")), CastConfig(get_format("e4m3")), CastConfig(get_format("e5m2")))
    convert_to_fp8(a, recipe)
    convert_to_fp8(b, recipe)
    x = torch.randn(3, 5, 64)
    ya, yb = a(x), b(x)
    assert torch.equal(ya, yb)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(conv.weight.grad, lin.weight.grad.t()) and torch.equal(conv.bias.grad, lin.bias.grad)
    # and the converted Conv1D is the FP8 emulation of the original: close to it in float32
    ref = x.reshape(-1, 64) @ conv.weight.detach() + conv.bias.detach()
    assert torch.allclose(ya.reshape(-1, 48), ref, rtol=0.2, atol=0.2)


def test_subclasses_convert_and_the_filter_takes_module_and_fqn():
    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(MyLinear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4)))
    seen = []

    def keep(mod, fqn):
        seen.append((type(mod).__name__, fqn))
        return fqn != "2"

    convert_to_fp8(model, "te-delayed", module_filter_fn=keep)
    assert seen == [("MyLinear", "0"), ("Linear", "2"), ("Linear", "3.0")]
    assert isinstance(model[0], Fp8Linear) and type(model[2]) is nn.Linear and isinstance(model[3][0], Fp8Linear)


def test_clear_errors_nothing_converted_and_already_converted():
    with pytest.raises(ValueError, match="nothing converted: the model has no nn.Linear"):
        convert_to_fp8(nn.Sequential(nn.ReLU()), "te-delayed")
    with pytest.raises(ValueError, match="nothing converted: module_filter_fn .* rejected all 2"):
        convert_to_fp8(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), "te-delayed", module_filter_fn=lambda m, n: False)
    model = convert_to_fp8(tiny_gpt2(), "te-delayed")
    with pytest.raises(ValueError, match="already converted"):
        convert_to_fp8(model, "te-delayed")


# -- 2. dtypes --------------------------------------------------------------------------------------


def _one_layer(bias=False, seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(64, 48, bias=bias))
    with torch.no_grad():
        if bias:
            m[0].bias.normal_()
    return convert_to_fp8(m, "te-current")


@pytest.mark.parametrize("bias", [False, True])
def test_autocast_output_is_one_bf16_rounding_of_the_float32_result(bias):
    x = torch.randn(32, 64) * 3
    ref = _one_layer(bias)(x)  # float32, no autocast
    model = _one_layer(bias)
    with torch.autocast("cpu", torch.bfloat16):
        y = model(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, ref.to(torch.bfloat16))  # not one output differs (26.5% did)
    y.float().sum().backward()
    assert model[0].weight.grad.dtype == torch.float32


def test_model_to_bfloat16_after_conversion_trains_in_bfloat16():
    model = convert_to_fp8(tiny_llama(), "te-delayed")
    model.to(torch.bfloat16)
    out = model(tokens(1), labels=tokens(1))
    assert out.logits.dtype == torch.bfloat16
    out.loss.backward()
    assert {p.grad.dtype for p in model.parameters() if p.grad is not None} == {torch.bfloat16}
    # one layer: the bf16 output is the float32 result (same bf16 operands) rounded once
    layer = model.model.layers[0].mlp.up_proj
    x = torch.randn(4, 64).to(torch.bfloat16)
    ref = nn.Sequential(nn.Linear(64, 128, bias=False))
    with torch.no_grad():
        ref[0].weight.copy_(layer.weight.float())
    convert_to_fp8(ref, "te-current")
    cur = nn.Sequential(nn.Linear(64, 128, bias=False)).to(torch.bfloat16)
    with torch.no_grad():
        cur[0].weight.copy_(layer.weight)
    convert_to_fp8(cur, "te-current")
    assert torch.equal(cur(x), ref(x.float()).to(torch.bfloat16))


def test_a_deep_copy_is_its_own_model():
    import copy

    model = convert_to_fp8(nn.Sequential(nn.Linear(16, 8)), "te-delayed")
    twin = copy.deepcopy(model)
    x = torch.randn(4, 16)
    twin(x).sum().backward()  # observed by the copy's state only
    assert get_fp8_state(twin).policies["activation"].state_dict()["tensors"]
    assert not get_fp8_state(model).policies["activation"].state_dict()["tensors"]
    assert twin[0].weight.grad is not None and model[0].weight.grad is None


# -- 3. the output layer, found by what it is ------------------------------------------------------


def _tiny_bert_mlm():
    tf = transformers()
    torch.manual_seed(0)
    return tf.BertForMaskedLM(tf.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                            intermediate_size=64, max_position_embeddings=32))


def test_the_output_layer_is_kept_by_what_it_is_unless_asked_and_recipe_skips_still_apply():
    model = convert_to_fp8(_tiny_bert_mlm(), get_recipe("te-current", skip=("query",)))
    decoder = model.cls.predictions.decoder  # BERT's vocabulary projection: no "lm_head" in its name
    assert type(decoder) is nn.Linear and decoder is model.get_output_embeddings()
    reasons = {n: why for n, (_, why) in get_fp8_state(model).summary.high_precision.items()}
    assert reasons == {"cls.predictions.decoder.weight": "output layer",
                       "bert.encoder.layer.0.attention.self.query.weight": "recipe skip list"}
    assert isinstance(model.bert.encoder.layer[0].attention.self.key, Fp8Linear)
    converted = convert_to_fp8(_tiny_bert_mlm(), "te-current", keep_output_layer=False)
    assert isinstance(converted.cls.predictions.decoder, Fp8Linear)
    # a filter replaces the skip rule, not keep_output_layer
    filtered = convert_to_fp8(_tiny_bert_mlm(), "te-current", module_filter_fn=lambda m, fqn: True)
    assert type(filtered.cls.predictions.decoder) is nn.Linear


def test_a_linear_tied_to_an_embedding_is_an_output_layer_in_any_model():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.body = nn.Linear(8, 8)
            self.proj = nn.Linear(8, 16, bias=False)
            self.proj.weight = self.emb.weight

        def forward(self, x):
            return self.proj(self.body(self.emb(x)))

    model = convert_to_fp8(Tied(), "te-delayed")
    assert isinstance(model.body, Fp8Linear) and type(model.proj) is nn.Linear
    assert get_fp8_state(model).summary.high_precision == {"proj.weight": (128, "output layer")}


# -- 5. a recipe's autocast -------------------------------------------------------------------------


def test_a_recipes_autocast_is_applied_to_every_forward_and_left_when_it_raises():
    x = tokens(1)
    auto = convert_to_fp8(tiny_llama(), get_recipe("te-delayed", autocast="bfloat16"))
    manual = convert_to_fp8(tiny_llama(), "te-delayed")
    a = auto(x, labels=x)
    with torch.autocast("cpu", torch.bfloat16):
        b = manual(x, labels=x)
    assert a.logits.dtype == torch.bfloat16 and torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)
    a.loss.backward()
    b.loss.backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(auto.parameters(), manual.parameters()))
    assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(IndexError):
        auto(x + 1000)  # token ids past the vocabulary: the embedding raises inside the forward
    assert not torch.is_autocast_enabled("cpu")


def test_fp8lm_prepare_applies_the_recipes_autocast_too():
    from fp8sim.training import fp8lm

    run = fp8lm.prepare(tiny_llama(), get_recipe("fp8lm-o1", autocast="bfloat16"))
    assert run.model(tokens(1)).logits.dtype == torch.bfloat16

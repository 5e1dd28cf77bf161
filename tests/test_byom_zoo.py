"""The Hugging Face model zoo: tiny models of many architectures, built from configs, convert and
train in FP8 -- every linear layer and MoE experts module in FP8 but the output layer (found by
what it is) and the routers, nothing left unconverted, two training steps to a finite loss that
reach every FP8 weight. A new architecture that breaks conversion shows up here."""

import warnings

import pytest
import torch
import torch.nn as nn

from fp8sim.training import convert_to_fp8, get_fp8_state
from fp8sim.training.coverage import is_linear
from fp8sim.training.experts import is_fp8_experts, is_hf_experts
from fp8sim.training.fp8_linear import Fp8Linear
from tests.test_byom_convert import tokens, transformers

V = 128  # vocabulary
ATTN = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=V,
            max_position_embeddings=64, intermediate_size=64)
MOE = dict(ATTN, num_experts_per_tok=2)
BERTISH = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
SEQ2SEQ = dict(vocab_size=V, d_model=32, decoder_start_token_id=0, pad_token_id=0)

#: name -> (config class, model class, config arguments, whether the model takes decoder labels)
ZOO = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=32, n_layer=2, n_head=4, vocab_size=V, n_positions=64,
                                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", ATTN),
    "mistral": ("MistralConfig", "MistralForCausalLM", ATTN),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(ATTN, head_dim=8)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(ATTN, pad_token_id=0)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(ATTN, head_dim=8)),
    "bert": ("BertConfig", "BertForMaskedLM", BERTISH),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", dict(BERTISH, pad_token_id=1)),
    "distilbert": ("DistilBertConfig", "DistilBertForMaskedLM", dict(vocab_size=V, dim=32, n_layers=2, n_heads=4,
                                                                     hidden_dim=64, max_position_embeddings=64,
                                                                     dropout=0.0, attention_dropout=0.0)),
    "t5": ("T5Config", "T5ForConditionalGeneration", dict(SEQ2SEQ, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                                          dropout_rate=0.0)),
    "bart": ("BartConfig", "BartForConditionalGeneration", dict(
        SEQ2SEQ, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(MOE, num_local_experts=4)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(MOE, num_experts=4, moe_intermediate_size=32,
                                                                shared_expert_intermediate_size=32)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(MOE, num_experts=4, moe_intermediate_size=32,
                                                                head_dim=8)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(MOE, num_experts=4)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(MOE, num_local_experts=4, head_dim=8, sliding_window=16)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        MOE, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
        topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)),
}
MOE_MODELS = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3"}


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread(one_torch_thread):
    yield


def build(name: str) -> nn.Module:
    tf = transformers()
    cfg_cls, model_cls, kw = ZOO[name]
    torch.manual_seed(0)
    return getattr(tf, model_cls)(getattr(tf, cfg_cls)(**kw)).train()


@pytest.mark.parametrize("name", list(ZOO))
def test_a_tiny_model_converts_and_trains_with_every_gemm_in_fp8_but_the_output_layer_and_routers(name):
    model = build(name)
    head = model.get_output_embeddings()
    linears = {n for n, m in model.named_modules() if is_linear(m) and m is not head}
    experts = {n for n, m in model.named_modules() if is_hf_experts(m)}
    assert (name in MOE_MODELS) == bool(experts)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing that holds parameters is left unconverted
        convert_to_fp8(model, "te-current")  # just-in-time scales: every step's gradients reach every layer
    state = get_fp8_state(model)
    fp8 = {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    routers = {n.rsplit(".", 1)[0] for n, (_, why) in state.summary.high_precision.items() if why == "router"}
    assert type(model.get_output_embeddings()) is nn.Linear  # found by what it is, whatever its name
    assert fp8 == linears - routers and all(is_fp8_experts(model.get_submodule(n)) for n in experts)
    assert state.summary.fp8_share == 1.0 and not state.summary.not_converted
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in (1, 2):
        x = tokens(step, vocab=V)
        opt.zero_grad()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        assert torch.isfinite(loss)
        opt.step()
    params = dict(model.named_parameters())
    assert all(params[n].grad is not None and params[n].grad.abs().sum() > 0 for n in state.summary.fp8)
    assert state.step == 2

"""Activation checkpointing recomputes each forward with exactly its own casts.

A layer may run several times before one backward (a block shared by two calls, a contrastive
loss over two forwards of the model, nested checkpoints); each recompute must reuse the scales,
stochastic-rounding keys and NVFP4 tensor amaxes of the forward it repeats, so that every
gradient equals the one of the same run without checkpointing, bit for bit.
"""

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from fp8sim.recipes import get_recipe
from fp8sim.training import convert_to_fp8, get_fp8_state
from tests.test_byom_convert import tokens

RECIPES = ["te-delayed", "te-current", "te-block", "mx", "nvfp4", "fp8lm-o1"]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread(one_torch_thread):
    yield


def _recipe(name):
    r = get_recipe(name)
    return r.linear if name.startswith("fp8lm") else r  # FP8-LM's linear level (its E4M3 weight gradients)


class SharedBlocks(nn.Module):
    """A block called twice per forward (weight sharing, as ALBERT's), each call checkpointed with a
    checkpointed sub-block inside (nested); ``mode``: None (no checkpointing), "reentrant" or
    "non-reentrant". No residual connection goes around a checkpointed region: a reentrant
    checkpoint sums the gradient of a region's input over its uses inside the region before
    adding the outside ones, so in float32 (without FP8) torch's gradients would differ in the
    last bits from those without checkpointing (the control in the test)."""

    def __init__(self, mode):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(128, 32)
        self.block = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 32))
        self.inner = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
        self.mode = mode

    def _ck(self, fn, *args):
        if self.mode is None:
            return fn(*args)
        return checkpoint(fn, *args, use_reentrant=self.mode == "reentrant")

    def _body(self, h):
        return self.block(h) + self._ck(self.inner, h)

    def forward(self, x):  # (B, T) -> (B, 32)
        h = self.emb(x)
        for _ in range(2):
            h = self._ck(self._body, h)
        return h.mean(1)


def _contrastive_steps(model, steps=2):
    """Two forwards of the model (two views of a batch) and one backward per step, plain SGD;
    returns every step's gradients."""
    grads = []
    for step in range(1, steps + 1):
        model.zero_grad(set_to_none=True)
        a, b = tokens(step), tokens(step + 100)
        za, zb = model(a), model(b)
        logits = za @ zb.t()  # (B, B): InfoNCE, the matching rows are the positives
        loss = nn.functional.cross_entropy(logits, torch.arange(len(logits)))
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.1 * p.grad
    return grads


@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_shared_nested_blocks_and_two_forwards_per_backward_give_the_gradients_without_checkpointing(recipe, mode):
    if recipe == RECIPES[0]:  # the control: in float32, torch's checkpointing changes no gradient bit here
        for a, b in zip(_contrastive_steps(SharedBlocks(None)), _contrastive_steps(SharedBlocks(mode))):
            assert all(torch.equal(a[n], b[n]) for n in a)
    ref = convert_to_fp8(SharedBlocks(None), _recipe(recipe))
    g_ref = _contrastive_steps(ref)
    model = convert_to_fp8(SharedBlocks(mode), _recipe(recipe))
    g = _contrastive_steps(model)
    for step, (a, b) in enumerate(zip(g_ref, g), 1):
        differ = [n for n in a if not torch.equal(a[n], b[n])]
        assert not differ, f"step {step}: gradients differ from the run without checkpointing: {differ}"
    assert get_fp8_state(model).state_dict() == get_fp8_state(ref).state_dict()
    assert get_fp8_state(model).pop_events() == get_fp8_state(ref).pop_events()


def test_hf_bert_two_forwards_with_gradient_checkpointing_gives_the_same_gradients():
    """The issue's case: a sentence-embedding loss over two forwards of a BERT encoder, Hugging
    Face's gradient checkpointing (non-reentrant) against none, te-delayed."""
    from tests.test_byom_convert import transformers

    tf = transformers()

    def bert(ckpt):
        torch.manual_seed(0)
        cfg = tf.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)
        m = tf.BertModel(cfg, add_pooling_layer=False)
        if ckpt:
            m.activation_checkpointing_enable()
        m.train()
        return convert_to_fp8(m, "te-delayed")

    class Pooled(nn.Module):
        def __init__(self, enc):
            super().__init__()
            self.enc = enc

        def forward(self, x):
            return self.enc(input_ids=x).last_hidden_state.mean(1)

    g_ref = _contrastive_steps(Pooled(bert(False)))
    g = _contrastive_steps(Pooled(bert(True)))
    for a, b in zip(g_ref, g):
        assert [n for n in a if not torch.equal(a[n], b[n])] == []

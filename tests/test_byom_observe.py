"""Policies observe only training forwards with autograd; activation checkpointing observes once."""

import copy

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from fp8sim.trace import TraceReader
from fp8sim.training import convert_to_fp8, get_fp8_state, record
from tests.test_byom_convert import tiny_llama, tokens


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _rows(path):
    """Every trace record as comparable plain data, sorted by (step, name)."""
    out = []
    for r in TraceReader(path).records():
        out.append((r.step, r.name, r.numel, r.amax, r.scale, r.overflow, r.underflow, r.zero,
                    tuple(r.hist.bins.tolist()), tuple(r.hist.counts.tolist())))
    return sorted(out)


def test_eval_and_no_grad_forwards_change_no_policy_count_or_trace_row(tmp_path):
    model = convert_to_fp8(tiny_llama(), "te-delayed")
    state = get_fp8_state(model)
    rec = record(model, tmp_path / "trace")
    model(tokens(1), labels=tokens(1)).loss.backward()
    state.pop_events()
    rec.flush()
    before = (copy.deepcopy(state.state_dict()), _rows(tmp_path / "trace"))
    x = tokens(2) * 0 + 127  # a different batch, so an observation would show
    model.eval()
    model(x, labels=x).loss.backward()  # eval mode, even with autograd: nothing observed
    model.train()
    with torch.no_grad():
        model(x)  # training mode without autograd: nothing observed
    rec.flush()
    assert state.state_dict() == before[0]
    assert state.pop_events() == {"overflow": 0, "underflow": 0}
    assert _rows(tmp_path / "trace") == before[1]
    rec.close()


def _train(model, steps, trace, *, ckpt_fn=None):
    """te-delayed steps; returns the gradients of every step (name -> tensor)."""
    grads = []
    with record(model, trace):
        for step in range(1, steps + 1):
            model.zero_grad(set_to_none=True)
            x = tokens(step)
            loss = ckpt_fn(model, x) if ckpt_fn else model(x, labels=x).loss
            loss.backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.05 * p.grad  # plain SGD: the next step's amaxes depend on this one
    return grads


def test_hf_gradient_checkpointing_gives_the_same_gradients_and_trace_rows(tmp_path):
    ref = convert_to_fp8(tiny_llama(), "te-delayed")
    g_ref = _train(ref, 3, tmp_path / "plain")
    model = convert_to_fp8(tiny_llama(), "te-delayed")
    # transformers 5: use_reentrant=False (5.x renames it activation_checkpointing_enable)
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    model.train()
    g = _train(model, 3, tmp_path / "ckpt")
    for a, b in zip(g_ref, g):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert get_fp8_state(model).state_dict() == get_fp8_state(ref).state_dict()
    rows, rows_ref = _rows(tmp_path / "ckpt"), _rows(tmp_path / "plain")
    assert len(rows) == len(rows_ref) == 3 * 14 * 4  # 14 layers x (input, weight, grad_output, weight_grad)
    assert rows == rows_ref


class _Mlp(nn.Module):
    def __init__(self, checkpointed: bool, use_reentrant: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(128, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(2))
        self.head = nn.Linear(32, 128)
        self.checkpointed, self.use_reentrant = checkpointed, use_reentrant

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = h + (checkpoint(b, h, use_reentrant=self.use_reentrant) if self.checkpointed else b(h))
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), x.flatten())


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_torch_checkpoint_gives_the_same_gradients_and_trace_rows(tmp_path, use_reentrant):
    recipe_kw = dict(module_filter_fn=lambda m, fqn: fqn != "head")

    def run(checkpointed, trace):
        m = convert_to_fp8(_Mlp(checkpointed, use_reentrant), "te-delayed", **recipe_kw)
        return m, _train(m, 3, trace, ckpt_fn=lambda model, x: model(x))

    ref, g_ref = run(False, tmp_path / "plain")
    m, g = run(True, tmp_path / "ckpt")
    for a, b in zip(g_ref, g):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert get_fp8_state(m).state_dict() == get_fp8_state(ref).state_dict()
    assert _rows(tmp_path / "ckpt") == _rows(tmp_path / "plain")

"""The plain-model recorder (``fp8sim.training.record`` on a model that is not converted) traces
Hugging Face ``Conv1D`` layers (GPT-2's projections) as it traces ``nn.Linear``: the four roles,
the weight and its gradient as ``(out, in)`` (a Conv1D stores ``W^T``), values bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp8sim.trace import TraceReader
from fp8sim.training import record

tf = pytest.importorskip("transformers")


def test_gpt2_conv1d_layers_are_recorded(tmp_path):
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=16,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))  # fmt: skip
    convs = {n: m for n, m in model.named_modules() if isinstance(m, Conv1D)}
    assert set(convs) == {f"transformer.h.0.{s}" for s in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    w0 = {n: m.weight.detach().clone() for n, m in convs.items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # weights unchanged: step 1's are w0
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    grads = {}
    with record(model, tmp_path / "t", save_every=1):
        for _ in range(2):
            opt.zero_grad()
            model(ids, labels=ids).loss.backward()
            grads = {n: m.weight.grad.detach().clone() for n, m in convs.items()}
            opt.step()
    rd = TraceReader(tmp_path / "t")
    cat = {t.name: t for t in rd.tensors}
    for n, m in convs.items():
        nx, nf = m.weight.shape  # Conv1D: weight (in, out)
        for suffix, role, fmt, shape in ((".input", "activation", "e4m3", (16, nx)),
                                         (".weight", "weight", "e4m3", (nf, nx)),
                                         (".grad_output", "grad_output", "e5m2", (16, nf)),
                                         (".weight_grad", "weight_grad", "e5m2", (nf, nx))):  # fmt: skip
            t = cat[n + suffix]
            assert (t.role, t.format, t.shape) == (role, fmt, shape), n + suffix
        # the weight as W (out, in), bit for bit; its gradient likewise (lr 0: step 2's grad)
        assert torch.equal(rd.load_tensor(1, n + ".weight"), w0[n].t())
        assert torch.equal(rd.load_tensor(2, n + ".weight_grad"), grads[n].t())
        assert rd.record(1, n + ".weight").amax == float(w0[n].abs().max())
    assert sorted(np.unique(rd.scalars()["step"]).tolist()) == [1, 2]

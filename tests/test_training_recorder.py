"""The recorder: live FP8 runs and any user's loop write the trace format; counts agree with
the run's own, and a resumed recording equals the uninterrupted one."""

import numpy as np
import pytest
import torch
import torch.nn as nn

from fp8sim.trace import TraceReader
from fp8sim.training import record
from fp8sim.training.model import GPTConfig
from fp8sim.training.recorder import Recorder
from fp8sim.training.trainer import TrainConfig, Trainer, read_metrics


pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32)


@pytest.fixture(scope="module")
def corpus(stdlib_corpus):
    return stdlib_corpus


def _train(out, trace, corpus, *, steps=6, stop_after=None, resume=False, recipe="te-delayed", backend="torch"):
    cfg = TrainConfig(recipe=recipe, backend=backend, steps=steps, batch_size=4, warmup=2, eval_every=3,
                      eval_batches=1, checkpoint_every=3, model=TINY)

    def factory(model):
        return record(model, trace, chunk_steps=cfg.checkpoint_every, save_every=4, append=resume)

    t = Trainer(cfg, out, corpus=corpus, resume=resume, recorder_factory=factory)
    t.run(progress=False, stop_after=stop_after)
    return t


def test_fp8_run_trace_matches_live_counts(tmp_path, corpus):
    _train(tmp_path / "run", tmp_path / "trace", corpus)
    tr = TraceReader(tmp_path / "trace")
    names = {t.name: t for t in tr.tensors}
    layers = ["blocks.0.attn.c_attn", "blocks.0.attn.c_proj", "blocks.0.mlp.c_fc", "blocks.0.mlp.c_proj"]
    expected = {f"{l}.{s}" for l in layers for s in ("input", "weight", "grad_output", "weight_grad")}
    assert set(names) == expected
    assert names["blocks.0.mlp.c_fc.input"].role == "activation" and names["blocks.0.mlp.c_fc.input"].format == "e4m3"
    assert names["blocks.0.mlp.c_fc.grad_output"].format == "e5m2"
    assert names["blocks.0.mlp.c_fc.weight_grad"].role == "weight_grad"
    assert names["blocks.0.mlp.c_fc.weight"].shape == (4 * 32, 32)
    assert tr.steps().tolist() == [1, 2, 3, 4, 5, 6]
    # the trace's counts (numba histogram pass) equal the live run's (counted on the FP8 codes)
    sc = tr.scalars()
    cast_ids = [names[n].index for n in expected if not n.endswith("weight_grad")]
    for row in read_metrics(tmp_path / "run"):
        sel = (sc["step"] == row["step"]) & np.isin(sc["tensor"], cast_ids)
        assert int(sc["overflow"][sel].sum()) == row["overflow"]
        assert int(sc["underflow"][sel].sum()) == row["underflow"]
    # delayed scaling as recorded: step t's scale is fmax / max(amax of steps < t), step 1 uses 1
    s = tr.scalars("blocks.0.mlp.c_fc.input")
    assert s["scale"][0] == 1.0
    for t in range(1, 6):
        assert s["scale"][t] == np.float32(448) / np.float32(s["amax"][:t].max())
    assert set(tr.saved_tensors()) == {(st, n) for st in (1, 5) for n in expected}  # save_every=4


def test_resumed_recording_equals_uninterrupted(tmp_path, corpus):
    _train(tmp_path / "a", tmp_path / "ta", corpus)
    _train(tmp_path / "b", tmp_path / "tb", corpus, stop_after=5)  # killed after step 5: checkpoint and chunk at 3
    assert TraceReader(tmp_path / "tb").steps().tolist() == [1, 2, 3]
    _train(tmp_path / "b", tmp_path / "tb", corpus, resume=True)
    a, b = TraceReader(tmp_path / "ta").scalars(), TraceReader(tmp_path / "tb").scalars()
    for col in ("step", "tensor", "amax", "scale", "overflow", "underflow", "numel", "zero"):
        np.testing.assert_array_equal(a[col], b[col])
    assert [r["loss"] for r in read_metrics(tmp_path / "a")] == [r["loss"] for r in read_metrics(tmp_path / "b")]


def test_resume_after_an_interruption_that_flushed_the_trace(tmp_path, corpus):
    """Interrupted after step 5 with the trace flushed (Ctrl-C closes the recorder): the trace
    holds steps 4-5 past the step-3 checkpoint; the resumed run cuts them and records them again,
    ending with the uninterrupted run's trace (saved tensors included)."""
    _train(tmp_path / "a", tmp_path / "ta", corpus)
    t = _train(tmp_path / "b", tmp_path / "tb", corpus, stop_after=5)
    t.recorder.close()
    assert TraceReader(tmp_path / "tb").steps().max() == 5
    _train(tmp_path / "b", tmp_path / "tb", corpus, resume=True)
    ra, rb = TraceReader(tmp_path / "ta"), TraceReader(tmp_path / "tb")
    a, b = ra.scalars(), rb.scalars()
    for col in ("step", "tensor", "amax", "scale", "overflow", "underflow", "numel", "zero"):
        np.testing.assert_array_equal(a[col], b[col])
    assert ra.saved_tensors() == rb.saved_tensors()


def test_record_hook_on_a_plain_user_loop(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs = [torch.randn(8, 16) * (i + 1) for i in range(3)]
    grads, outs_grad = [], []
    with record(model, tmp_path / "trace", save_every=1) as rec:
        assert isinstance(rec, Recorder)
        for x in xs:
            out = model(x)
            out.retain_grad()
            loss = out.square().mean()
            opt.zero_grad()
            loss.backward()
            grads.append(model[0].weight.grad.clone())
            outs_grad.append(out.grad.clone())
            opt.step()
            with torch.no_grad():  # evaluation is not recorded and starts no step
                model(torch.randn(2, 16))
    tr = TraceReader(tmp_path / "trace")
    assert tr.steps().tolist() == [1, 2, 3]
    assert {t.name for t in tr.tensors} == {f"{i}.{s}" for i in (0, 2) for s in ("input", "weight", "grad_output", "weight_grad")}
    assert tr.config["hypothetical_recipe"] == "te-delayed" and tr.config["live_casts"] is False
    for step in (1, 2, 3):
        assert torch.equal(tr.load_tensor(step, "0.input"), xs[step - 1])
        assert torch.equal(tr.load_tensor(step, "0.weight_grad"), grads[step - 1])
        assert torch.equal(tr.load_tensor(step, "2.grad_output"), outs_grad[step - 1])
    # the hypothetical cast follows te-delayed: scale 1 at step 1, then fmax / amax history
    s = tr.scalars("0.input")
    np.testing.assert_array_equal(s["amax"], [float(x.abs().max()) for x in xs])
    assert s["scale"].tolist()[:2] == [1.0, float(np.float32(448) / np.float32(s["amax"][0]))]
    # hooks are gone after close: a further step changes nothing
    model(xs[0]).sum().backward()
    assert TraceReader(tmp_path / "trace").steps().tolist() == [1, 2, 3]

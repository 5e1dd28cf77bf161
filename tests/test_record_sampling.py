"""record(): sampling (every=N, full tensors on their own schedule), selection (roles, layers),
argument checks, and the background writer (errors surface, nothing lost on exit or interruption)."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn as nn

from fp8sim.errors import ArgumentError
from fp8sim.trace import TraceReader, TraceWriter
from fp8sim.trace.background import BackgroundWriter
from fp8sim.training import record

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _loop(model, steps=7):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        x = torch.randn(8, 16, generator=g) * (1 + i % 3)  # amax moves: a delayed history matters
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _run(tmp_path, name, steps=7, **kw):
    model = _model()
    with record(model, tmp_path / name, **kw):
        _loop(model, steps)
    return TraceReader(tmp_path / name)


def test_every_n_records_the_full_runs_steps_exactly(tmp_path):
    full = _run(tmp_path, "full")
    every = _run(tmp_path, "every3", every=3)
    assert every.steps().tolist() == [1, 4, 7]
    assert every.config["sampling"]["every"] == 3
    # the delayed policy observed the amaxes of steps 2-3 and 5-6 too: the same scales and counts
    for step in (1, 4, 7):
        for t in full.tensors:
            a, b = full.record(step, t.name), every.record(step, t.name)
            assert (a.scale, a.amax, a.overflow, a.underflow, a.numel) == (b.scale, b.amax, b.overflow, b.underflow,
                                                                          b.numel)
            np.testing.assert_array_equal(a.hist.counts, b.hist.counts)
    s = full.scalars("0.input")
    assert len(set(s["scale"].tolist())) > 2  # the scales do move, so the check above has teeth


def test_steps_between_can_be_left_unobserved(tmp_path):
    every = _run(tmp_path, "every3", every=3, observe_every_step=False)
    one = _run(tmp_path, "one", steps=3)
    # step 4's delayed scale comes from step 1's amax alone: fmax / amax(step 1)
    s = every.scalars("0.input")
    assert s["scale"][1] == np.float32(448) / np.float32(s["amax"][0])
    assert s["scale"][1] != one.scalars("0.input")["scale"][2]  # what the full history gives at step 3


def test_full_tensors_have_their_own_schedule(tmp_path):
    tr = _run(tmp_path, "t", every=3, save_every=2)
    assert tr.steps().tolist() == [1, 3, 4, 5, 7]  # recorded: every 3rd, and every saved step
    assert sorted({s for s, _ in tr.saved_tensors()}) == [1, 3, 5, 7]


def test_roles_and_layers_pick_what_is_recorded(tmp_path):
    tr = _run(tmp_path, "t", steps=2, roles="weight,grad_output", layers=["2"])
    assert {t.name for t in tr.tensors} == {"2.weight", "2.grad_output"}
    tr = _run(tmp_path, "u", steps=2, roles=["activation"], layers=lambda n, m: m.in_features == 16)
    assert {t.name for t in tr.tensors} == {"0.input"}
    assert tr.config["sampling"]["layers"] == ["0"]


@pytest.mark.parametrize("kw,named", [
    ({"every": 0}, "every"), ({"every": 2.5}, "every"), ({"every": True}, "every"),
    ({"save_every": -1}, "save_every"), ({"roles": ["weights"]}, "roles"), ({"roles": []}, "roles"),
    ({"layers": "blocks.*"}, "layers"), ({"layers": 3}, "layers"), ({"layers": lambda n, m: False}, "layers"),
    ({"recipe": "nope"}, "recipe"), ({"chunk_steps": 0}, "chunk_steps"),
    ({"observe_every_step": 1}, "observe_every_step"),
])
def test_bad_arguments_are_named(tmp_path, kw, named):
    with pytest.raises(ArgumentError) as e:
        record(_model(), tmp_path / "t", **kw)
    assert e.value.arguments == (named,)
    assert not (tmp_path / "t").exists()  # nothing written for a refused call


def test_a_failing_write_surfaces_and_stops_writing(tmp_path):
    tw = TraceWriter(tmp_path / "t", {})
    tw.add_tensor("a", "weight", "e4m3", (3,))
    bg = BackgroundWriter(tw)
    bg.submit(lambda w: w.record(1, "a", np.ones(3, np.float32), scale=1.0))
    bg.submit(lambda w: w.record(2, "nope", np.ones(3, np.float32), scale=1.0))  # not declared
    bg.submit(lambda w: w.record(3, "a", np.ones(3, np.float32), scale=1.0))
    with pytest.raises(RuntimeError, match="background writer failed: ValueError: tensor 'nope' not declared"):
        bg.drain()
    bg.close()
    assert TraceReader(tmp_path / "t").steps().tolist() == [1]  # what came before the failure


def test_unclosed_recorder_is_flushed_at_exit(tmp_path):
    script = textwrap.dedent(f"""
        import torch, torch.nn as nn
        from fp8sim.training import record
        model = nn.Linear(8, 8)
        rec = record(model, {str(tmp_path / 't')!r}, chunk_steps=100)
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
        # no close(): the process ends with every step still buffered
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    assert TraceReader(tmp_path / "t").steps().tolist() == [1, 2, 3]


def test_interrupted_loop_keeps_its_recorded_steps(tmp_path):
    model = _model()
    with pytest.raises(KeyboardInterrupt):
        with record(model, tmp_path / "t", chunk_steps=100):
            _loop(model, 3)
            raise KeyboardInterrupt
    assert TraceReader(tmp_path / "t").steps().tolist() == [1, 2, 3]


def test_the_accelerator_path_writes_the_same_trace(tmp_path, monkeypatch):
    """Statistics as device rows (torch ops), one copy per step, amaxes observed late: the trace
    equals the host path's, bit for bit (checked on CPU tensors: no accelerator here)."""
    from fp8sim.training.recorder import Recorder

    host = _run(tmp_path, "host", steps=4, every=2)
    monkeypatch.setattr(Recorder, "_device_path_on_cpu", True)
    dev = _run(tmp_path, "dev", steps=4, every=2)
    a, b = host.scalars(), dev.scalars()
    for col in a:
        np.testing.assert_array_equal(a[col], b[col], err_msg=col)
    for ra, rb in zip(host.records(), dev.records()):
        np.testing.assert_array_equal(ra.hist.bins, rb.hist.bins)
        np.testing.assert_array_equal(ra.hist.counts, rb.hist.counts)

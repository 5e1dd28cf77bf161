"""torch.compile of a converted model: one graph, no graph break, no per-layer recompile."""

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from fp8sim.training import convert_to_fp8, get_fp8_state, record
from tests.test_byom_convert import tiny_llama, tokens
from tests.test_byom_observe import _rows


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    torch.set_num_threads(n)


def _train(model, fn, steps, loss_of, *, set_step=False):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(1, steps + 1):
        if set_step:  # the loop owns the step (as the trainers do)
            get_fp8_state(model).step = step
        opt.zero_grad()
        loss = loss_of(fn, step)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _llama_loss(fn, step):
    x = tokens(step)
    return fn(x, labels=x).loss


def test_aot_eager_llama_is_one_graph_and_equals_eager_bit_for_bit(tmp_path):
    ref = convert_to_fp8(tiny_llama(), "te-delayed")
    # (recording the eager run first also starts numba's threads, which change torch's thread
    # count once: a compiled run that starts them itself recompiles once, at its second step)
    with record(ref, tmp_path / "eager"):
        eager = _train(ref, ref, 3, _llama_loss)
    model = convert_to_fp8(tiny_llama(), "te-delayed")
    with record(model, tmp_path / "compiled"):  # the recorder's taps run inside the opaque FP8 op
        compiled = _train(model, torch.compile(model, backend="aot_eager"), 3, _llama_loss)
    assert compiled == eager
    assert _rows(tmp_path / "compiled") == _rows(tmp_path / "eager")
    assert sum(counters["graph_break"].values()) == 0  # was 122 (.item() in Fp8State.cast, numpy, ...)
    assert counters["stats"]["unique_graphs"] == 1  # was 114, with the recompile limit hit per layer name
    assert counters["frames"]["total"] == 1
    st, st_ref = get_fp8_state(model), get_fp8_state(ref)
    assert st.step == 3 and st.state_dict() == st_ref.state_dict()  # histories and step move as in eager


def test_inductor_equals_eager_within_float32_rounding():
    """(A plain nn.Module whose loop leaves the step to fp8sim graph-breaks once, at the root's
    step hook, before its graph: torch.compile traces that module's hooks, Hugging Face's
    models are compiled below them. Setting ``state.step`` removes the hook.)"""
    def mlp():
        torch.manual_seed(0)
        return convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)), "te-delayed")

    x = torch.randn(8, 32)

    def loss_of(fn, step):
        return (fn(x * step) ** 2).mean()

    ref = mlp()
    eager = _train(ref, ref, 3, loss_of, set_step=True)
    model = mlp()
    compiled = _train(model, torch.compile(model, backend="inductor"), 3, loss_of, set_step=True)
    assert sum(counters["graph_break"].values()) == 0 and counters["stats"]["unique_graphs"] == 1
    # the FP8 GEMMs are the same (opaque op); inductor fuses the float32 ops around them (GELU,
    # the mean, SGD) and rounds those differently: a few ulps at step 1, which later steps carry
    assert compiled[0] == pytest.approx(eager[0], rel=8 * 2.0**-24, abs=0)
    assert compiled == pytest.approx(eager, rel=1e-5, abs=0)

"""record() on a model with FP8 MoE experts: each expert recorded as its own linear, tokens per
expert in its input records, an idle expert's step an empty record that no analysis takes for
an underflow. The reference: the same experts as a loop of per-expert FP8 linears (an expert
that gets no token does not run there), recorded by the linear path."""

import dataclasses

import numpy as np
import pytest
import torch

from fp8sim.trace import TraceReader
from fp8sim.training import convert_to_fp8, record
from tests.test_byom_moe import D, E, K, Holder, PerExpertLoop, _experts


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread(one_torch_thread):
    yield


IDLE = {1: 2, 2: 1, 3: 2}  # step -> the expert no token is routed to (expert 1 idle at step 2 only)


def _routing(step, tokens=12, idle=None):
    """Top-2 routing over every expert but ``idle`` (default IDLE[step]), random weights."""
    idle = IDLE[step] if idle is None else idle
    g = torch.Generator().manual_seed(step)
    x = torch.randn(tokens, D, generator=g)
    others = [e for e in range(E) if e != idle]
    idx = torch.tensor(others)[torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(tokens)])]
    return x, idx, torch.softmax(torch.randn(tokens, K, generator=g), -1)


def _train(model, path, steps=(1, 2, 3), **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with record(model, path, **kw):
        for step in steps:
            x, idx, w = _routing(step, **({"idle": kw["config"]["idle"]} if "config" in kw else {}))
            opt.zero_grad()
            model(x, idx, w).square().sum().backward()
            opt.step()
    return TraceReader(path)


def _records(reader):
    return {(r.step, r.name): r for r in reader.records()}


def _same(a, b):
    return (a.numel, a.zero, a.nan, a.inf, a.overflow, a.underflow, a.scale, a.format) == \
        (b.numel, b.zero, b.nan, b.inf, b.overflow, b.underflow, b.scale, b.format) and \
        np.array_equal(a.hist.bins, b.hist.bins) and np.array_equal(a.hist.counts, b.hist.counts) and \
        (a.amax == b.amax)  # fmt: skip


@pytest.mark.parametrize("recipe", ["te-delayed", "te-block"])
def test_experts_are_recorded_per_expert_as_a_loop_of_fp8_linears_and_idle_steps_are_empty(tmp_path, recipe):
    got = _train(convert_to_fp8(Holder(_experts("mixtral")), recipe), tmp_path / "experts")
    ref = _train(convert_to_fp8(PerExpertLoop(_experts("mixtral")), recipe), tmp_path / "loop")
    g, r = _records(got), _records(ref)
    assert set(r) <= set(g)
    differ = [k for k in r if not _same(g[k], r[k])]
    assert not differ, differ[:5]
    for (step, name), rec in g.items():  # what the loop has not: the idle experts' steps, all empty
        e = int(name.split(".")[2])
        assert ((step, name) not in r) == (e == IDLE[step]), (step, name)
        if (step, name) not in r:
            assert rec.numel == 0 and rec.underflow == 0 and rec.overflow == 0
    # tokens per expert: the rows of its input records, against the routing counted by hand
    for step in IDLE:
        routed = torch.bincount(_routing(step)[1].reshape(-1), minlength=E).tolist()
        for proj, width in (("gate_up_proj", D), ("down_proj", 48)):
            rows = [g[step, f"experts.{proj}.{e}.input"].numel // width for e in range(E)]
            assert rows == routed
    roles = {t.name.rsplit(".", 1)[1] for t in got.tensors}
    assert roles == {"input", "weight", "grad_output", "weight_grad"} and len(got.tensors) == 2 * E * 4


def test_an_idle_experts_empty_step_is_no_underflow_in_the_summary_the_verdicts_or_a_replay(tmp_path):
    from fp8sim.analysis.policy_replay import replay_policies
    from fp8sim.analysis.trace_summary import summarize_trace
    from fp8sim.analysis.verdict import layer_verdicts

    got = _train(convert_to_fp8(Holder(_experts("mixtral")), "te-delayed"), tmp_path / "experts")
    ref = _train(convert_to_fp8(PerExpertLoop(_experts("mixtral")), "te-delayed"), tmp_path / "loop")
    def summary(reader):  # an activation first seen idle is declared (0, width): its shape as first seen
        return {t.name: dataclasses.replace(t, file="", shape=t.shape[1:] if t.role in ("activation", "grad_output")
                                            else t.shape) for t in summarize_trace("", reader).tensors}

    rows, want = summary(got), summary(ref)
    assert rows == want  # each expert's row: its active steps only
    assert rows["experts.down_proj.1.input"].steps == 2 and rows["experts.down_proj.2.input"].steps == 1
    assert {v.tensor: v for v in layer_verdicts("", got)} == {v.tensor: v for v in layer_verdicts("", ref)}
    specs = ["delayed:history=4", "current"]

    def by_name(reader):
        out = {}
        for rp in replay_policies(reader, specs):
            for c in ("step", "scale", "underflow_lo", "underflow_hi", "overflow_lo", "nonzero"):
                for i, t in enumerate(rp.cols["tensor"]):
                    out.setdefault((rp.policy, rp.names[t], int(rp.cols["step"][i])), {})[c] = rp.cols[c][i]
        return out

    assert by_name(got) == by_name(ref)  # an empty record is not observed: the delayed history is the loop's


def test_rank_traces_merge_when_an_expert_is_idle_on_one_rank_only(tmp_path):
    from fp8sim.trace.merge import merge_rank_traces

    run = tmp_path / "record"
    readers = []
    for rank, idle in ((0, 2), (1, 0)):  # same weights, just-in-time scales: replicated weights agree
        model = convert_to_fp8(Holder(_experts("mixtral")), "te-current")
        readers.append(_train(model, run / f"rank{rank}", steps=(1,), config={"idle": idle}))
    merged = TraceReader(merge_rank_traces(run, tmp_path / "merged"))
    w2 = merged.record(1, "experts.down_proj.2.weight")  # cast on rank 1 only: its record
    assert _same(w2, readers[1].record(1, "experts.down_proj.2.weight")) and w2.numel == D * 48
    x2 = merged.record(1, "experts.down_proj.2.input")  # partitioned: rank 0's empty record adds nothing
    assert _same(x2, readers[1].record(1, "experts.down_proj.2.input"))
    x1 = merged.record(1, "experts.down_proj.1.input")
    assert x1.numel == sum(r.record(1, "experts.down_proj.1.input").numel for r in readers)


def test_experts_left_in_high_precision_are_named_in_one_warning(tmp_path):
    from tests.test_byom_moe import _tiny_moe

    plain = _tiny_moe("mixtral")
    with pytest.warns(UserWarning, match=r"record: 2 MoE experts modules run in high precision and are not recorded "
                                         r"\(first: model.layers.0.mlp.experts\)"):
        record(plain, tmp_path / "plain").close()
    kept = convert_to_fp8(_tiny_moe("mixtral"), "te-delayed", module_filter_fn=lambda m, fqn: "experts" not in fqn)
    with pytest.warns(UserWarning, match="2 MoE experts modules"):
        record(kept, tmp_path / "kept").close()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FP8 experts are recorded: no warning
        record(convert_to_fp8(_tiny_moe("mixtral"), "te-delayed"), tmp_path / "fp8").close()

"""Casts a run performs and the what-if ones its trace records besides (weight gradients under
te-* recipes): flagged in the catalogue, labelled, left out of the summary, the verdict, the
fail_on rules and the replay unless asked for, and counted alike by compare, analyze and replay."""

import json

import pytest
import torch
import torch.nn as nn

from fp8sim import cli
from fp8sim.analysis import analyze, replay
from fp8sim.trace import TraceReader
from fp8sim.training import record
from fp8sim.training.compare import compare_runs
from fp8sim.training.model import GPTConfig
from fp8sim.training.trainer import TrainConfig, Trainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32)


@pytest.fixture(scope="module")
def run(tmp_path_factory, stdlib_corpus):
    """A te-delayed run of 6 steps, recorded (full tensors at steps 1 and 5)."""
    d = tmp_path_factory.mktemp("whatif")
    cfg = TrainConfig(recipe="te-delayed", backend="torch", steps=6, batch_size=4, warmup=2, eval_every=0,
                      eval_batches=1, checkpoint_every=0, model=TINY)  # fmt: skip
    Trainer(cfg, d / "run", corpus=stdlib_corpus,
            recorder_factory=lambda m: record(m, d / "trace", save_every=4)).run(progress=False)
    return d


def test_the_catalogue_flags_the_casts_the_recipe_does_not_perform(run, tmp_path):
    tr = TraceReader(run / "trace")
    flags = {t.name: t.what_if for t in tr.tensors}
    assert {n for n, w in flags.items() if w} == {n for n in flags if n.endswith(".weight_grad")}
    assert len(flags) == 16 and sum(flags.values()) == 4
    # a plain model recorded through hooks under te-delayed's casts: the same split
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    with record(model, tmp_path / "plain"):
        for _ in range(2):
            model(torch.randn(8, 16)).square().mean().backward()
    plain = {t.name: t.what_if for t in TraceReader(tmp_path / "plain").tensors}
    assert plain == {f"{i}.{r}": r == "weight_grad" for i in (0, 2)
                     for r in ("input", "weight", "grad_output", "weight_grad")}  # fmt: skip


def test_a_trace_written_before_the_flag_is_read_the_same(run, tmp_path):
    """Old traces have no what_if key: a weight gradient the recorder logged with the output
    gradient's cast (format and policy) is a what-if one; anything else is not."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(run / "trace", old)
    meta = json.loads((old / "trace.json").read_text())
    for t in meta["tensors"]:
        del t["what_if"]
    (old / "trace.json").write_text(json.dumps(meta))
    new_flags = {t.name: t.what_if for t in TraceReader(run / "trace").tensors}
    assert {t.name: t.what_if for t in TraceReader(old).tensors} == new_flags
    # a recipe that casts its weight gradients (its own format / policy): performed
    meta["config"]["casts"]["weight_grad"] = {"format": "e4m3", "policy": "msamp:window=1"}
    (old / "trace.json").write_text(json.dumps(meta))
    assert not any(t.what_if for t in TraceReader(old).tensors)


def test_analyze_lists_what_if_rows_apart_and_counts_them_only_when_asked(run, capsys):
    res = analyze(str(run / "trace"))
    rows = res.traces[0].tensors
    hypo = [r for r in rows if r.what_if]
    assert len(hypo) == 4 and all(r.role == "weight_grad" for r in hypo)
    assert sum(res.counts.values()) == len(res.records) - sum(r.what_if for r in res.records) + 12
    assert res.what_if_rows == 4 + sum(r.what_if for r in res.records) > 4  # saved weight gradients too
    assert all(not v.what_if for v in res.verdicts) and len(res.verdicts) == 12
    both = analyze(str(run / "trace"), what_if=True)
    assert sum(both.counts.values()) == len(both.records) + 16
    assert len(both.verdicts) == 16 and {v.role for v in both.verdicts if v.what_if} == {"weight_grad"}
    table = res.table(top=0)
    assert "what-if casts -- recorded, but not performed by the run" in table
    assert table.index("what-if casts") > table.index("recorded statistics over all steps")
    assert "(what-if)" in both.table(top=0).split("verdict per layer and role")[1]
    # the gate follows the summary: a rule crossed only by what-if rows does not fire
    only_hypo = "amax>0"  # crossed by every row: check which rows it names
    crossed = {c.name for c in analyze(str(run / "trace"), fail_on=only_hypo).crossings}
    assert crossed and not any(".weight_grad" in n for n in crossed)
    assert any(".weight_grad" in c.name for c in analyze(str(run / "trace"), fail_on=only_hypo, what_if=True).crossings)
    # the command line says how many it did not count
    assert cli.main(["analyze", str(run / "trace")]) == 0
    err = capsys.readouterr().err
    assert f"({res.what_if_rows} what-if rows, casts the run did not perform, not counted)" in err


def test_replay_leaves_what_if_records_out_unless_asked(run, capsys):
    rp = replay(str(run / "trace"), ["current"])
    tr = TraceReader(run / "trace")
    hypo = {t.index for t in tr.tensors if t.what_if}
    assert all(int(t) not in hypo for r in rp.replays for t in r.cols["tensor"])
    assert rp.trace_records == 6 * 12 and rp.what_if_records == 6 * 4
    full = replay(str(run / "trace"), ["current"], what_if=True)
    assert full.trace_records == 6 * 16 and full.what_if_records == 0
    # the performed tensors' figures do not depend on whether the what-if ones were replayed
    for a, b in zip(rp.replays, full.replays):
        keep = ~torch.isin(torch.from_numpy(b.cols["tensor"]), torch.tensor(sorted(hypo))).numpy()
        for col in a.cols:
            assert (a.cols[col] == b.cols[col][keep]).all(), col
    assert "(what-if)" in full.table(by="tensor") and "(what-if)" not in rp.table(by="tensor")
    assert cli.main(["replay", str(run / "trace"), "--policy", "current"]) == 0
    assert "left out 24 records of 4 what-if tensor(s)" in capsys.readouterr().err


def test_compare_analyze_and_replay_count_the_same_casts(run, stdlib_corpus, tmp_path):
    cfg = TrainConfig(recipe="bf16", steps=6, batch_size=4, warmup=2, eval_every=0, eval_batches=1,
                      checkpoint_every=0, model=TINY)  # fmt: skip
    Trainer(cfg, tmp_path / "bf16", corpus=stdlib_corpus).run(progress=False)
    events = compare_runs(tmp_path / "bf16", run / "run")["events"]["b"]
    rows = [r for r in analyze(str(run / "trace")).traces[0].tensors if not r.what_if]
    (recorded,) = [p for p in replay(str(run / "trace"), ["current"]).replays if p.policy == "recorded"]
    assert events["underflow_total"] > 0  # the warm-up step alone underflows
    for key in ("overflow", "underflow"):
        assert events[f"{key}_total"] == sum(getattr(r, key) for r in rows) == int(recorded.cols[f"{key}_lo"].sum())

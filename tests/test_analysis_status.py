"""The statuses (fp8sim.analysis.status), the gates built on them, and the notes that keep a
first hour free of contradictions: options that cannot apply, formats that are no named format,
nothing analyzed."""

import json

import numpy as np
import pytest
import torch

from fp8sim import cli
from fp8sim.analysis import analyze
from fp8sim.analysis.report import parse_fail_on
from fp8sim.analysis.status import Thresholds, classify, classify_steps, step_statuses, warmup_length

TH = Thresholds(underflow_warning=2.0, underflow_critical=20.0, overflow_warning=0.1, overflow_critical=1.0,
                steps_critical=10.0)  # fmt: skip


def _rec(**kw):
    return {"overflow": 0, "overflow_pct": 0.0, "underflow_pct": 0.0, "nan": 0, "inf": 0, "lost": 0,
            "scaling": "tensor"} | kw  # fmt: skip


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("rec, status", [
    (_rec(), "ok"),
    (_rec(overflow=1, overflow_pct=0.003), "ok"),  # a handful of saturated values
    (_rec(overflow=3, overflow_pct=0.1), "warning"),
    (_rec(overflow=30, overflow_pct=1.0), "critical"),
    (_rec(underflow_pct=1.99), "ok"),
    (_rec(underflow_pct=2.0), "warning"),
    (_rec(underflow_pct=20.0), "critical"),
    (_rec(underflow_pct=100.0), "critical"),  # a tensor whose values (gradients) vanish
    (_rec(nan=1), "warning"),
    (_rec(lost=32), "warning"),
    (_rec(underflow_pct=float("nan")), "critical"),  # never shown to stay below a threshold
    # the MX floor rule's clamping: a warning from the overflow warning share, never critical
    (_rec(scaling="mx", overflow=2, overflow_pct=0.05), "ok"),
    (_rec(scaling="mx", overflow=300, overflow_pct=9.0), "warning"),
])
def test_one_cast_is_judged_by_the_shares_of_its_values(rec, status):
    assert classify(rec, TH) == status


def test_a_traced_tensor_is_judged_by_the_share_of_its_steps():
    # per step: overflow share, underflow share, NaN+inf
    ov = np.array([0.0, 0.0, 2.0, 0.2, 0.0])
    un = np.array([0.0, 25.0, 0.0, 0.0, 0.0])
    st = step_statuses(ov, un, np.array([0, 0, 0, 0, 1]), TH)
    assert st.tolist() == [2, 0, 0, 1, 1]  # ok, critical (underflow), critical (overflow), warning x2
    assert classify_steps(st, TH) == "critical"  # 2 of 5 steps critical: 40% >= 10%
    many = np.full(20, 2)
    many[3] = 0  # one critical step in 20: 5%
    assert classify_steps(many, TH) == "warning"
    assert classify_steps(np.full(20, 2), TH) == "ok" and classify_steps(np.array([], int), TH) == "ok"


def test_warmup_is_the_scale_one_steps_before_the_first_scaled_one():
    assert warmup_length([1.0, 1.0, 8.0, 4.0]) == 2
    assert warmup_length([8.0, 1.0]) == 0  # just in time: no warm-up
    assert warmup_length([1.0, 1.0]) == 0 and warmup_length([]) == 0  # static scaling


def test_thresholds_are_checked():
    with pytest.raises(ValueError, match="--overflow-warning 2 / --overflow-critical 1"):
        Thresholds(overflow_warning=2.0, overflow_critical=1.0)
    with pytest.raises(ValueError, match="steps_critical"):
        Thresholds(steps_critical=0.0)


def test_fail_on_status_words_and_clamped_values_under_their_own_name(tmp_path, capsys):
    """One 32-block with amax 480: the OCP floor rule clamps it to 448 (1 value in 64). overflow
    never counts it, clamped does; --fail-on warning crosses on that row's status."""
    x = np.ones(64, np.float32)
    x[5] = 480.0
    np.save(tmp_path / "x.npy", x)
    f = str(tmp_path / "x.npy")
    base = ["analyze", f, "--format", "e4m3", "--scaling", "mx", "--overflow-warning", "1"]
    assert run(capsys, *base, "--fail-on", "overflow>0")[0] == 0
    rc, _, err = run(capsys, *base, "--fail-on", "clamped>0")
    assert rc == 1 and "first: clamped>0 by x (e4m3, mx)" in err
    assert run(capsys, *base, "--fail-on", "critical")[0] == 0  # clamping is never critical
    assert run(capsys, *base, "--fail-on", "warning")[0] == 1  # 1.56% clamped >= 1%
    assert run(capsys, *base[:-2], "--fail-on", "warning")[0] == 1
    rules = parse_fail_on("critical,overflow>0")
    assert [str(r) for r in rules] == ["critical", "overflow>0"]
    with pytest.raises(ValueError, match="or a status: critical or warning"):
        parse_fail_on("fatal")
    from fp8sim.analysis.report import REPLAY_FAIL_METRICS

    with pytest.raises(ValueError, match="'critical'"):  # replay records have no status
        parse_fail_on("critical", REPLAY_FAIL_METRICS)


def test_nothing_analyzed_is_exit_2_with_the_reason_unless_allowed(tmp_path, capsys):
    torch.save({"ids": torch.arange(4)}, tmp_path / "ints.pt")
    rc, out, err = run(capsys, "analyze", str(tmp_path / "ints.pt"))
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "no data analyzed in" in err and "ids: skipped: int64 tensor" in err and "--allow-empty" in err
    rc, out, err = run(capsys, "analyze", str(tmp_path / "ints.pt"), "--allow-empty", "--fail-on", "critical")
    assert rc == 0 and "no float tensors analyzed" in out
    with pytest.raises(ValueError, match="no data analyzed"):
        analyze(tmp_path / "ints.pt")
    assert analyze(tmp_path / "ints.pt", allow_empty=True).counts == {"critical": 0, "warning": 0, "ok": 0}


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """A plain model recorded through hooks, 4 steps, no full tensor saved."""
    from fp8sim.training import record

    d = tmp_path_factory.mktemp("trace") / "t"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    with record(model, d):
        for _ in range(4):
            model(torch.randn(16, 32)).square().mean().backward()
    return d


def test_formats_for_a_trace_without_saved_tensors_are_noted_not_ignored(trace, capsys):
    rc, out, err = run(capsys, "analyze", str(trace), "--format", "e4m3,e5m2", "--scaling", "tensor,mx")
    assert rc == 0
    assert "the formats and scalings asked for apply to the full tensors a trace saved, and this one saved none" in err
    assert "the formats and scalings" not in run(capsys, "analyze", str(trace))[2]  # none asked for: no note
    res = analyze(str(trace), formats="e4m3")
    assert any("saved none" in n.note for n in res.notes)


def test_repr_shows_what_it_promises(trace):
    """print(result) of a trace without saved tensors: the summary, the worst trace tensors and
    the verdicts (no records to show)."""
    res = analyze(str(trace))
    text = repr(res)
    head = text.splitlines()[0]
    assert head.startswith("AnalysisResult: 0 records") and res.summary_line() in head
    assert "worst trace tensors (recorded statistics):" in text
    worst = res.worst(1)[0]
    assert worst.name in text.split("worst trace tensors")[1]
    assert "verdicts: " in text


def test_a_generic_format_gets_a_note(tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.linspace(-3, 3, 64, dtype=np.float32))
    rc, _, err = run(capsys, "analyze", str(tmp_path / "x.npy"), "--format", "e4m4")
    assert rc == 0 and "note: --format e4m4 is not a named format: it is a generic IEEE-like 9-bit format" in err
    assert "note:" not in run(capsys, "analyze", str(tmp_path / "x.npy"), "--format", "e4m3,e5m2,e3m4")[2]
    rc, _, err = run(capsys, "cast", "1.1", "--format", "e4m4")
    assert rc == 0 and "e4m4 is not a named format" in err and "the named ones: e4m3, e5m2" in err
    assert "note" not in run(capsys, "cast", "1.1", "--format", "e4m3fn")[2]  # an alias is named
    from fp8sim.formats import generic_format_note, get_format

    assert get_format("e4m4").bits == 9 and generic_format_note("bf16") is None and generic_format_note("x1") is None


def test_a_pickled_module_gets_advice_the_command_line_can_follow(tmp_path, capsys):
    torch.save(torch.nn.Linear(4, 4), tmp_path / "model.pt")
    rc, _, err = run(capsys, "analyze", str(tmp_path / "model.pt"))
    assert rc == 2 and "torch.save(model.state_dict(), path)" in err and "add_safe_globals" not in err
    assert "GLOBAL torch.nn.modules.linear.Linear" in err


def test_plot_axes_of_steps_and_counts_have_whole_number_ticks(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fp8sim.analysis.plots import integer_ticks

    fig, ax = plt.subplots()
    ax.imshow(np.zeros((2, 4)), extent=[0.5, 4.5, 1.5, -0.5], aspect="auto")  # steps 1..4
    integer_ticks(ax.xaxis)
    fig.canvas.draw()
    lo, hi = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
    plt.close(fig)
    assert ticks and all(float(t).is_integer() for t in ticks)


def test_the_json_counts_what_if_rows_apart(trace, tmp_path):
    doc = json.loads(analyze(str(trace)).to_json())
    assert doc["what_if"] == {"rows": 2, "counted": False}  # the two linears' weight gradients
    assert sum(doc["summary"].values()) == 6

"""Transformer Engine debug logs, written by nvdlfw-inspect's own logger (the one TE's
LogTensorStats / LogFp8TensorStats call) on two gloo ranks, read back: names split into layer,
tensor and statistic, 4-decimal precision kept as an interval, ranks of one reduction group
never summed."""

import subprocess
import sys
import textwrap

import pytest

from fp8sim.trace.te_logs import read_te_logs, split_name, te_log_files

pytest.importorskip("nvdlfw_inspect")

# what each rank logs: (name, iteration, value on rank 0, value on rank 1). Group statistics are
# combined before logging, so both ranks log the same value; the last one is logged per rank
# (skip_reduction) and differs.
LOGGED = [
    ("decoder.1.self_attention.linear_qkv_activation_cur_amax", 1, 3.25, 3.25),
    ("decoder.1.self_attention.linear_qkv_activation_fp8_delayed_scaling_underflows%", 1, 0.00001, 0.00001),
    ("decoder.1.self_attention.linear_qkv_activation_fp8_delayed_scaling_underflows%", 2, 12.345678, 12.345678),
    ("decoder.1.self_attention.linear_qkv_weight_mxfp8_scale_inv_min", 1, 2.0 ** -10, 2.0 ** -10),
    ("decoder.1.mlp.linear_fc1_gradient_fp8_delayed_scaling_overflows%_columnwise", 1, 0.5, 0.5),
    ("decoder.1.mlp.linear_fc1_activation_weight_max", 1, -0.25, -0.25),  # a layer named ..._activation
    ("decoder.1.mlp.linear_fc2_wgrad_max", 3, 1.0, 2.0),
]

SCRIPT = textwrap.dedent("""
    import sys, torch.distributed as dist
    rank, root, init = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=init)
    import nvdlfw_inspect.logging as L
    L.initialize_logger(root)
    L.MetricLogger.add_logger(L.make_default_statistics_logger())
    for name, it, v0, v1 in {logged!r}:
        L.MetricLogger.log_scalar(name, v0 if rank == 0 else v1, it)
    dist.barrier()
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def te_log(tmp_path_factory):
    root = tmp_path_factory.mktemp("te")
    init = f"file://{root / 'rendezvous'}"
    code = SCRIPT.format(logged=LOGGED)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(root), init]) for r in (0, 1)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    return root


def test_the_logger_writes_one_file_per_rank(te_log):
    files = te_log_files(te_log)
    assert sorted(files) == [0, 1]
    assert files[1].name == "nvdlfw_inspect_globalrank-1.log"


def test_names_values_and_precision(te_log):
    log = read_te_logs(te_log)
    assert log.skipped == 0 and len(log.stats) == len(LOGGED)
    qkv = "decoder.1.self_attention.linear_qkv"
    amax = log.stats[(qkv, "activation", "cur_amax", 1)]
    assert (amax.value, amax.lo, amax.hi) == (3.25, 3.25 - 0.00005, 3.25 + 0.00005)
    tiny = log.stats[(qkv, "activation", "fp8_delayed_scaling_underflows%", 1)]
    assert tiny.value == 0.0 and tiny.below_precision and (tiny.lo, tiny.hi) == (0.0, 0.00005)
    assert log.stats[(qkv, "activation", "fp8_delayed_scaling_underflows%", 2)].value == 12.3457  # as written
    assert log.stats[(qkv, "weight", "mxfp8_scale_inv_min", 1)].value == 0.001  # 2**-10 to 4 decimals
    assert ("decoder.1.mlp.linear_fc1", "gradient", "fp8_delayed_scaling_overflows%_columnwise", 1) in log.stats
    neg = log.stats[("decoder.1.mlp.linear_fc1_activation", "weight", "max", 1)]
    assert neg.lo == -0.25 - 0.00005  # a signed statistic keeps its lower end


def test_ranks_of_a_group_are_taken_once_never_summed(te_log):
    log = read_te_logs(te_log)
    same = log.stats[("decoder.1.self_attention.linear_qkv", "activation", "cur_amax", 1)]
    assert same.ranks == (0, 1) and not same.ranks_differ and same.value == 3.25
    apart = log.stats[("decoder.1.mlp.linear_fc2", "wgrad", "max", 3)]
    assert apart.ranks_differ and apart.per_rank == {0: 1.0, 1: 2.0}


def test_split_name_and_errors(tmp_path):
    assert split_name("l_activation_max") == ("l", "activation", "max")
    assert split_name("no_tensor_here") is None
    with pytest.raises(ValueError, match="no Transformer Engine debug statistics logs"):
        read_te_logs(tmp_path)


def test_analyze_reads_the_log_and_says_what_it_cannot(te_log):
    from fp8sim.analysis import analyze

    res = analyze(str(te_log))
    notes = {n.name: n.note for n in res.notes}
    assert "no histogram" in notes[None]
    qkv = notes["decoder.1.self_attention.linear_qkv.activation"]
    assert "amax 3.25" in qkv and "fp8_delayed_scaling_underflows% worst 12.3457%" in qkv
    assert "ranks differ in max" in notes["decoder.1.mlp.linear_fc2.wgrad"]


def test_replay_from_logged_amaxes(te_log):
    from fp8sim.analysis.te_log_summary import replay_te_log
    from fp8sim.trace.te_logs import read_te_logs

    rows = replay_te_log(read_te_logs(te_log), ["current", "static:scale=200"])
    cur = {(r["policy"].split(":")[0], r["layer"], r["tensor"]): r["steps"] for r in rows}
    # current scaling: 448 / amax; the amax never overflows its own scale
    (it, scale, event), = cur[("current", "decoder.1.self_attention.linear_qkv", "activation")]
    assert it == 1 and scale == pytest.approx(448 / 3.25, rel=1e-6) and event is False
    # static 200: 3.25 * 200 = 650 > 464 (E4M3's overflow threshold): an event, exactly
    assert cur[("static", "decoder.1.self_attention.linear_qkv", "activation")][0][2] is True
    with pytest.raises(ValueError, match="block amaxes"):
        replay_te_log(read_te_logs(te_log), ["mx"])


def test_replay_command_reads_the_log(te_log, capsys):
    """`fp8sim replay TE_LOG --policy ...` gives the logged amaxes' scales and events, says what it
    cannot give, and refuses the options that need an fp8sim trace."""
    import json

    from fp8sim.cli import main

    assert main(["replay", str(te_log), "--policy", "static:scale=200", "--policy", "current", "--json", "-"]) == 0
    out = capsys.readouterr()
    rows = {(r["policy"].split(":")[0], r["tensor"]): r for r in json.loads(out.out)["rows"]}
    qkv = rows[("static", "decoder.1.self_attention.linear_qkv.activation")]
    assert qkv["events"] == 1 and qkv["scale_min"] == qkv["scale_max"] == 200.0  # 3.25 * 200 > 464
    assert rows[("current", "decoder.1.self_attention.linear_qkv.activation")]["events"] == 0
    assert "need the histograms" in out.err
    assert main(["replay", str(te_log), "--policy", "current", "--fail-on", "events>0"]) == 2
    assert "needs an fp8sim trace" in capsys.readouterr().err

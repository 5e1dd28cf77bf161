"""Bad option values of policies / replay / conformance / cast: one error line, exit 2, before any
work (found by an adversarial review); and output into a closed pipe is not an error."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from fp8sim import cli
from fp8sim.trace import TraceWriter


def run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("spec, says", [
    ("msamp:window=1e30", "window must be >= 1 and <= 1048576"),
    ("msamp:window=100000000000", "window must be >= 1 and <= 1048576"),
    ("msamp:window=0", "window must be >= 1"),
    ("current:epsilon=-1", "epsilon must be finite and >= 0"),
    ("current:epsilon=inf", "epsilon must be finite and >= 0"),
    ("current:margin=200", "margin must be finite with |margin| <= 126"),
    ("current:margin=1e400", "margin must be finite with |margin| <= 126"),
])  # fmt: skip
def test_policy_specs_out_of_range_are_refused(capsys, tmp_path, spec, says):
    rc, _, err = run(capsys, "policies", spec)
    assert rc == 2 and says in err and len(err.strip().splitlines()) == 1
    with TraceWriter(tmp_path / "t") as tw:  # a trace without records: refused all the same
        tw.add_tensor("a", "activation", "e4m3", (4,))
    rc, _, err = run(capsys, "replay", tmp_path / "t", "--policy", spec)
    assert rc == 2 and says in err


def test_policies_json_is_strict_json(capsys):
    rc, out, _ = run(capsys, "policies", "current:epsilon=1e-12", "--json")
    assert rc == 0 and json.loads(out)["params"]["epsilon"] == 1e-12
    rc, out, _ = run(capsys, "policies", "--json")
    assert rc == 0 and "Infinity" not in out and "NaN" not in out and json.loads(out)


def test_replay_counts_each_policy_once(capsys, tmp_path):
    with TraceWriter(tmp_path / "t") as tw:
        tw.add_tensor("a", "activation", "e4m3", (8,))
        for s in range(4):
            tw.record(s, "a", np.arange(8, dtype=np.float32) + s, scale=1.0)
    rc, _, err = run(capsys, "replay", tmp_path / "t", "--policy", "current",
                     "--policy", "current:margin=0", "--policy", "delayed")  # fmt: skip
    assert rc == 0 and "replayed 4 records under 3 policies" in err  # 2 + the recorded one


@pytest.mark.parametrize("argv, says", [
    (["--patterns", "99999999999"], "--patterns must be in 1..67108864"),
    (["--patterns", "0"], "--patterns must be in 1..67108864"),
    (["--library", "nosuch"], "--library 'nosuch': valid: torch, ml_dtypes, triton"),
])  # fmt: skip
def test_conformance_bad_options(capsys, argv, says):
    rc, _, err = run(capsys, "conformance", *argv)
    assert rc == 2 and says in err


def test_cast_random_bits_need_stochastic_rounding(capsys):
    rc, _, err = run(capsys, "cast", "1", "--srbits", "5")
    assert rc == 2 and "--seed and --srbits are for --rounding stochastic" in err
    rc, _, err = run(capsys, "cast", "1", "--seed", "3", "-r", "rtz")
    assert rc == 2
    rc, out, _ = run(capsys, "cast", "1.1", "-r", "stochastic", "--seed", "3", "--srbits", "5")
    assert rc == 0 and ("0x39" in out or "0x3a" in out)


def test_output_into_a_closed_pipe_is_not_an_error():
    proc = subprocess.run(f"{sys.executable} -m cli policies --json | head -c 1",
                          shell=True, capture_output=True, text=True)  # fmt: skip
    assert proc.stdout == "{" and proc.stderr == ""


@pytest.mark.parametrize("exc", [MemoryError("Unable to allocate 32.0 GiB"),
                                 RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried")])  # fmt: skip
def test_out_of_memory_is_one_line_not_a_bug(capsys, monkeypatch, exc):
    import fp8sim.commands.formats as formats_cmd

    def boom(args):
        raise exc

    monkeypatch.setattr(formats_cmd, "run", boom)
    rc, _, err = run(capsys, "formats")
    assert rc == 2 and err.startswith("fp8sim formats: error: out of memory") and "a bug" not in err


def test_training_data_must_be_a_file_or_directory(capsys, tmp_path):
    import socket

    sock = socket.socket(socket.AF_UNIX)  # a socket file: neither regular nor a directory (and,
    sock.bind(str(tmp_path / "s"))  # unlike a FIFO, opening it fails at once instead of blocking)
    try:
        rc, _, err = run(capsys, "train", "--data", tmp_path / "s", "--steps", "1", "--out",
                         tmp_path / "r")  # fmt: skip
    finally:
        sock.close()
    assert rc == 2 and "not a regular file or a directory" in err


def test_an_interrupt_wrapped_by_numba_is_an_interrupt(capsys, monkeypatch):
    from fp8sim.commands import formats as formats_cmd

    def wrapped(args):  # what numba raises when Ctrl-C lands inside a compiled function
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as exc:
            raise SystemError("CPUDispatcher returned a result with an exception set") from exc

    monkeypatch.setattr(formats_cmd, "run", wrapped)
    rc, _, err = run(capsys, "formats")
    assert (rc, err.strip()) == (130, "fp8sim formats: interrupted")


def test_an_interrupt_while_the_commands_load_is_one_line(capsys, monkeypatch):
    # Ctrl-C during the first second (the command modules import torch): no traceback
    from fp8sim import cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    rc, _, err = run(capsys, "analyze", "x.npy")
    assert (rc, err.strip()) == (130, "fp8sim: interrupted")

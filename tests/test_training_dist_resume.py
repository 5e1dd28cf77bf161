"""Checkpoint/resume of data-parallel and FP8-LM runs (torch.distributed.checkpoint): a run
stopped after a step and resumed from its last checkpoint -- under real torchrun, or in one
process -- writes the same losses, bit for bit, and ends in the same state (FP8 policies,
AutoScale, optimizer shards, model) as the run that never stopped under ``--nproc``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from fp8sim.training.dist_checkpoint import latest_checkpoint
from fp8sim.training.distributed import train_distributed
from tests.conftest import tiny_train_config


def _cfg(recipe: str, steps: int = 6):
    return tiny_train_config(recipe, steps=steps, checkpoint_every=2)


def _rows(run) -> list[dict]:
    return [json.loads(line) for line in open(run / "metrics.jsonl")]


def _assert_same(a, b, where: str = "") -> None:
    """Exact equality of nested checkpoint payloads (tensors and arrays bit for bit)."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bool else a, b), where
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, set(a) ^ set(b))
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and np.isnan(a):
        assert np.isnan(b), where
    else:
        assert a == b, (where, a, b)


def _checkpoint(run) -> dict:
    """The whole last checkpoint of a run directory, read in this process (DCP, no process group)."""
    import warnings

    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    step = latest_checkpoint(run)["step"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return _load_state_dict_from_keys(checkpoint_id=str(run / "checkpoint" / f"step{step:08d}"))


def _torchrun(*args: str) -> None:
    """``torchrun --standalone --nproc-per-node 2 -m fp8sim train ARGS`` (real torchrun)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "fp8sim", "train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def _stop_resume_and_compare(tmp_path, recipe: str, nproc: int, record: bool = False):
    cfg = _cfg(recipe)
    full, cut = tmp_path / "full", tmp_path / "cut"
    rec = ({"record": tmp_path / "trace-full", "save_every": 2}, {"record": tmp_path / "trace-cut", "save_every": 2})
    rec = rec if record else ({}, {})
    train_distributed(cfg, full, nproc=nproc, progress=False, **rec[0])
    train_distributed(cfg, cut, nproc=nproc, progress=False, stop_after=3, **rec[1])  # as if killed after step 3
    # the last complete checkpoint is step 2 (every 2 steps); older ones are gone
    assert latest_checkpoint(cut) == {"step": 2, "world": nproc}
    assert [d.name for d in (cut / "checkpoint").glob("step*")] == ["step00000002"]
    assert [r["step"] for r in _rows(cut)] == [1, 2, 3] and not (cut / "run.json").exists()
    train_distributed(cfg, cut, nproc=nproc, progress=False, resume=True, **rec[1])
    a, b = _rows(full), _rows(cut)
    if record:  # the trace (flushed through step 3 when stopped) is cut back to 2 and re-recorded
        from fp8sim.trace import TraceReader

        for r in range(nproc):
            ta, tb = (TraceReader(tmp_path / f"trace-{k}" / f"rank{r}") for k in ("full", "cut"))
            sa, sb = ta.scalars(), tb.scalars()
            assert sorted(set(sb["step"].tolist())) == list(range(1, 7))
            assert all(np.array_equal(sa[k], sb[k]) for k in sa) and ta.saved_tensors() == tb.saved_tensors()
    assert [r["step"] for r in b] == list(range(1, 7))  # step 3 was run again, logged once
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    ca, cb = _checkpoint(full), _checkpoint(cut)
    for key in ("model", "optim", "fp8"):
        _assert_same(ca[key], cb[key], key)
    _assert_same(ca["extra"]["reducer"], cb["extra"]["reducer"], "reducer")
    _assert_same(ca["extra"]["rng"]["torch"], cb["extra"]["rng"]["torch"], "rng")  # Python's is unseeded
    sa, sb = (json.loads((d / "run.json").read_text()) for d in (full, cut))
    assert sa["final_loss"] == sb["final_loss"] and sa["steps_done"] == sb["steps_done"] == 6
    assert sa["memory_bytes_per_param"] == sb["memory_bytes_per_param"]
    return ca


#: ``fp8sim train`` flags of a 2-rank FP8-LM O3 run (6 steps, checkpoints every 2)
O3_FLAGS = ["--recipe", "fp8lm-o3", "--steps", "6", "--batch-size", "8", "--lr", "0.01", "--warmup", "2",
            "--eval-every", "0", "--checkpoint-every", "2", "--n-layer", "1", "--n-head", "2", "--n-embd", "32",
            "--block-size", "32"]  # fmt: skip


def test_torchrun_of_the_cli_trains_as_nproc_and_resumes_under_torchrun_and_on_one_rank(tmp_path):
    from fp8sim.cli import build_parser
    from fp8sim.commands.train import config_from_args, options_from_args

    args = build_parser().parse_args(["train", *O3_FLAGS])
    cfg, opts = config_from_args(args), {**options_from_args(args), "nproc": 2}
    tr, cut = tmp_path / "torchrun", tmp_path / "cut"
    # real torchrun, fresh: rank 0 alone creates the run directory and writes config.json
    _torchrun(*O3_FLAGS, "--out", str(tr))
    # --nproc 2 (torchrun's elastic launcher in this process), stopped after step 3 as if killed
    train_distributed(cfg, cut, nproc=2, progress=False, stop_after=3, run_options=opts)
    assert latest_checkpoint(cut) == {"step": 2, "world": 2}
    assert [d.name for d in (cut / "checkpoint").glob("step*")] == ["step00000002"]
    a, b = _rows(tr), _rows(cut)
    assert [r["step"] for r in b] == [1, 2, 3] and not (cut / "run.json").exists()
    for key in ("loss", "grad_norm", "lr", "comm_bytes", "allreduce"):  # torchrun == --nproc 2, bit for bit
        assert [r[key] for r in a[:3]] == [r[key] for r in b], key
    shutil.copytree(cut, tmp_path / "cut1")  # resumed on 1 rank below
    _torchrun("--resume", "--out", str(cut))  # every option from the run's config.json
    b = _rows(cut)
    assert [r["step"] for r in b] == list(range(1, 7))  # step 3 was run again, logged once
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    # FSDP2's shards, the FP16 masters and Adam states, FP8 state and AutoScale's mu, bit for bit
    ca, cb = _checkpoint(tr), _checkpoint(cut)
    for key in ("model", "optim", "fp8"):
        _assert_same(ca[key], cb[key], key)
    _assert_same(ca["extra"]["reducer"], cb["extra"]["reducer"], "reducer")
    sa, sb = (json.loads((d / "run.json").read_text()) for d in (tr, cut))
    assert sa["final_loss"] == sb["final_loss"] and sa["steps_done"] == sb["steps_done"] == 6
    assert sa["memory_bytes_per_param"] == sb["memory_bytes_per_param"]
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(tr / "checkpoint" / "step00000006")).read_metadata()
    chunks = meta.state_dict_metadata["optim.state.blocks.0.mlp.c_fc.weight.master"].chunks
    assert len(chunks) == 2 and ca["optim"]["state"]["blocks.0.mlp.c_fc.weight"]["master"].shape == (128, 32)
    # DCP reshards: the same checkpoint resumes on one rank (no FSDP there: the whole tensors)
    train_distributed(cfg, tmp_path / "cut1", nproc=1, progress=False, resume=True, run_options={**opts, "nproc": 1})
    one = _rows(tmp_path / "cut1")
    assert [r["step"] for r in one] == list(range(1, 7)) and [r["loss"] for r in one[:2]] == [r["loss"] for r in a[:2]]
    assert all(abs(x["loss"] - y["loss"]) <= 2e-3 * y["loss"] for x, y in zip(one[2:], a[2:]))


def test_one_rank_o2_resumes_bit_exactly(tmp_path):
    # Fp8AdamW state keeps its dtypes through load_state_dict (float16 masters, uint8 moments)
    _stop_resume_and_compare(tmp_path, "fp8lm-o2", 1, record=True)
    from fp8sim.training.distributed import DataParallel
    from fp8sim.training.trainer import Trainer

    run = Trainer(_cfg("fp8lm-o2"), tmp_path / "cut", data_parallel=DataParallel(), resume=True)
    st = next(iter(run.optimizer.state.values()))
    assert (st["master"].dtype, st["exp_avg"].dtype, st["exp_avg_sq"].dtype) == (
        torch.float16, torch.uint8, torch.float16)


def test_resume_refuses_a_different_run(tmp_path):
    cfg = _cfg("fp8lm-o1", steps=2)
    run = tmp_path / "run"
    with pytest.raises(FileNotFoundError, match="holds no run to resume"):
        train_distributed(cfg, run, progress=False, resume=True)
    train_distributed(cfg, run, progress=False)
    with pytest.raises(ValueError, match="already holds a run"):
        train_distributed(cfg, run, progress=False)
    recorded = tmp_path / "recorded"
    train_distributed(cfg, recorded, record=tmp_path / "trace", progress=False)
    with pytest.raises(ValueError, match="recorded by 1 ranks .* resume it with 1 ranks"):
        train_distributed(cfg, recorded, nproc=2, record=tmp_path / "trace", progress=False, resume=True)
    with pytest.raises(ValueError, match="different config"):
        train_distributed(_cfg("fp8lm-o1", steps=4), run, progress=False, resume=True)
    with pytest.raises(ValueError, match="trained with"):
        train_distributed(cfg, run, fp8_grads="linear", progress=False, resume=True)
    with pytest.raises(ValueError, match="fp8lm recipes"):
        train_distributed(_cfg("bf16"), tmp_path / "bf16", fp8_grads="all", progress=False)


def test_cli_resumes_an_fp8lm_run(tmp_path, capsys):
    from fp8sim import cli

    small = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "4",
             "--steps", "3", "--warmup", "1", "--eval-every", "3", "--checkpoint-every", "1", "--json"]
    out = str(tmp_path / "o2")
    assert cli.main(["train", "--recipe", "fp8lm-o2", "--out", out, *small]) == 0
    first = json.loads(capsys.readouterr().out)
    # resuming a finished run re-runs nothing and reports the same summary
    assert cli.main(["train", "--recipe", "fp8lm-o2", "--out", out, "--resume", *small]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["final_loss"] == first["final_loss"] and again["steps_done"] == 3
    assert cli.main(["train", "--recipe", "fp8lm-o2", "--out", out, "--resume", "--fp8-grads", "linear", *small]) == 2
    assert "trained with" in capsys.readouterr().err

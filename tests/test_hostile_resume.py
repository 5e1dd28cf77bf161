"""A resume forgets nothing and mixes nothing (issue 30, class 3 and 5; issue 34, item 6):
config.json stores every option that changes what a run writes (a walk over the parser), a
finished run resumed changes nothing and says so, ``--steps M`` extends a run with its
learning-rate schedule kept -- bit for bit the run asked for that schedule from the start -- and
a checkpoint of another run is refused instead of keeping the old run's metrics rows."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import torch

from fp8sim import cli
from fp8sim.training.trainer import read_metrics
from tests.conftest import TINY_TRAIN as SMALL, train_stopped_after


def train(capsys, *argv) -> tuple[int, str]:
    rc = cli.main(["train", *[str(a) for a in argv]])
    return rc, capsys.readouterr().err


def _train_parser() -> argparse.ArgumentParser:
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["train"]


def test_every_train_option_is_stored_and_restored_or_declared_transient(tmp_path, corpus):
    from fp8sim.commands import train as commands
    from fp8sim.training.config import TrainConfig
    from fp8sim.training.run_dir import write_run_config

    p = _train_parser()
    dests = {a.dest for a in p._actions if not isinstance(a, argparse._HelpAction)}
    stored = set(commands.CONFIG_FLAGS) | set(commands.RUN_OPTIONS)
    assert not set(commands.CONFIG_FLAGS) & set(commands.RUN_OPTIONS)
    assert not stored & set(commands.TRANSIENT_OPTIONS)
    assert dests == stored | set(commands.TRANSIENT_OPTIONS), "an option neither stored nor declared transient"
    out = tmp_path / "run"
    given = {  # a value other than the default for every stored option
        "recipe": "fp8lm-o1", "backend": "torch", "gemm_accumulate": "float64", "steps": "7", "seed": "5",
        "data": str(corpus), "batch_size": "6", "lr": "0.01", "warmup": "3", "decay_steps": "6",
        "eval_every": "2", "checkpoint_every": "3", "n_layer": "3", "n_head": "2", "n_embd": "48",
        "block_size": "24", "record": str(tmp_path / "t"), "save_every": "2", "nproc": "2",
        "grad_scaling": "msamp", "fp8_grads": "linear",
    }  # fmt: skip
    assert set(given) == stored, "give the new option a value here"
    argv = ["train", "--out", str(out)] + [x for k, v in given.items() for x in (f"--{k.replace('_', '-')}", v)]
    args = cli.build_parser().parse_args(argv)
    cfg, opts = commands.config_from_args(args), commands.options_from_args(args)
    default = TrainConfig().to_dict()
    for dest, path in commands.CONFIG_FLAGS.items():  # each one is in the config, not the default
        value = cfg.to_dict()["model"][path[6:]] if path.startswith("model.") else cfg.to_dict()[path]
        was = default["model"][path[6:]] if path.startswith("model.") else default[path]
        assert value != was, dest
    assert all(opts[k] != commands.RUN_OPTIONS[k] for k in commands.RUN_OPTIONS)
    out.mkdir()
    write_run_config(out, cfg, "0" * 32, opts)
    resumed = cli.build_parser().parse_args(["train", "--resume", "--out", str(out)])
    stored_cfg, stored_opts, run_id = commands._stored_config(resumed)
    assert commands.config_from_args(resumed, stored_cfg) == cfg
    assert commands.options_from_args(resumed, stored_opts) == opts and run_id == "0" * 32


def test_resume_forgets_neither_record_nor_save_every(tmp_path, capsys, corpus, monkeypatch):
    from fp8sim.trace import TraceReader

    out, t = tmp_path / "run", tmp_path / "t"
    train_stopped_after(monkeypatch, capsys, 2, "--data", corpus, *SMALL, "--recipe", "te-delayed", "--steps", 4,
                        "--checkpoint-every", 2, "--out", out, "--record", t, "--save-every", 2)  # fmt: skip
    rc, err = train(capsys, "--resume", "--out", out)
    assert rc == 0, err
    reader = TraceReader(t)
    assert reader.steps().tolist() == [1, 2, 3, 4]  # issue 30: the trace held 2 of the steps
    assert sorted({s for s, _ in reader.saved_tensors()}) == [1, 3]
    rc, err = train(capsys, "--resume", "--out", out, "--save-every", 3)
    assert rc == 2 and "--save-every 3: the run in --out was trained with 2; leave the option out" in err


def test_an_extended_recorded_run_appends_to_its_own_trace(tmp_path, capsys, corpus):
    """Extending a run changes its config (its steps): the trace is still its own (the run id says
    so), and the extension's steps are appended; another run's trace is still refused."""
    from fp8sim.trace import TraceReader

    out, t = tmp_path / "run", tmp_path / "t"
    assert train(capsys, "--data", corpus, *SMALL, "--recipe", "te-delayed", "--steps", 2, "--out", out,
                 "--record", t)[0] == 0  # fmt: skip
    rc, err = train(capsys, "--resume", "--out", out, "--steps", 3)
    assert rc == 0, err
    assert TraceReader(t).steps().tolist() == [1, 2, 3]
    other = tmp_path / "other"
    assert train(capsys, "--data", corpus, *SMALL, "--recipe", "te-delayed", "--steps", 1, "--out", other,
                 "--record", t)[0] == 2  # fmt: skip


def test_a_trace_inside_the_run_directory_starts_and_extends(tmp_path, capsys, corpus):
    """--record inside --out: the fresh start ignores the trace directory it just made (and only
    that: another entry is still refused), and an extension appends to it."""
    from fp8sim.trace import TraceReader

    out = tmp_path / "run"
    rc, err = train(capsys, "--data", corpus, *SMALL, "--recipe", "te-delayed", "--steps", 1, "--out", out,
                    "--record", out / "trace")  # fmt: skip
    assert rc == 0, err
    assert train(capsys, "--resume", "--out", out, "--steps", 2)[0] == 0
    assert TraceReader(out / "trace").steps().tolist() == [1, 2]
    other = tmp_path / "other"
    (other / "notes").mkdir(parents=True)
    (other / "notes" / "mine.txt").write_text("mine")
    rc, err = train(capsys, "--data", corpus, *SMALL, "--steps", 1, "--out", other, "--record", other / "trace")
    assert rc == 2 and "exists and is not empty" in err and (other / "notes" / "mine.txt").read_text() == "mine"


def _files(*roots) -> dict:
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for r in roots for p in sorted(r.rglob("*")) if p.is_file()}


def test_a_finished_run_resumed_says_so_and_changes_nothing(tmp_path, capsys, corpus):
    out, t = tmp_path / "run", tmp_path / "t"
    assert train(capsys, "--data", corpus, *SMALL, "--recipe", "te-delayed", "--steps", 2, "--out", out,
                 "--record", t)[0] == 0  # fmt: skip
    before = _files(out, t)
    rc = cli.main(["train", "--resume", "--out", str(out), "--json"])
    captured = capsys.readouterr()
    assert rc == 0 and json.loads(captured.out) == json.loads((out / "run.json").read_text())
    assert captured.err == (f"fp8sim train: {out}: the run is finished (2 of 2 steps); nothing changed "
                            "(--steps M with M > 2 extends it)\n")  # fmt: skip
    assert _files(out, t) == before  # not a byte, not a modification time
    rc, err = train(capsys, "--resume", "--out", out, "--steps", 1)
    assert rc == 2 and "--steps 1: the run in --out was asked for 2 steps; --steps extends it (more than 2)" in err


def _rows(run, keys=("step", "loss", "lr", "grad_norm", "overflow", "underflow")) -> list[tuple]:
    return [tuple(r.get(k) for k in keys) for r in read_metrics(run)]


@pytest.mark.parametrize("schedule", ["decay kept", "all warm-up"])
def test_an_extended_run_is_bit_exact_where_the_schedule_allows(tmp_path, capsys, corpus, schedule):
    """Extended from 4 to 6 steps, a run equals, bit for bit, the run asked for 6 steps with the
    same learning rates from the start: with the cosine ending at step 4 (``--decay-steps 4``);
    and, where every step is in the warm-up (the rate does not depend on the step count), the
    plain ``--steps 6`` run."""
    from fp8sim.training.config import TrainConfig

    base = ["--data", corpus, *SMALL, "--recipe", "te-delayed", "--checkpoint-every", 2]
    if schedule == "all warm-up":
        base += ["--warmup", 8]  # the later --warmup wins: steps 1..8 all warm up
    a, b = tmp_path / "a", tmp_path / "b"
    assert train(capsys, *base, "--steps", 4, "--out", a)[0] == 0
    rc, err = train(capsys, "--resume", "--out", a, "--steps", 6)
    assert rc == 0, err
    fresh = ["--steps", 6] + (["--decay-steps", 4] if schedule == "decay kept" else [])
    assert train(capsys, *base, *fresh, "--out", b)[0] == 0
    assert _rows(a) == _rows(b) and [r["step"] for r in read_metrics(a)] == list(range(1, 7))
    assert read_metrics(a)[-1]["val_loss"] == read_metrics(b)[-1]["val_loss"]
    cfg_a = json.loads((a / "config.json").read_text())
    assert (cfg_a["steps"], cfg_a["decay_steps"]) == (6, 4)  # the schedule it was trained with
    assert json.loads((a / "run.json").read_text())["steps_done"] == 6
    plain = TrainConfig(steps=6, warmup=1)  # the plain --steps 6 run's rates differ after the warm-up
    if schedule == "decay kept":
        assert plain.lr_at(3) != TrainConfig(steps=4, warmup=1).lr_at(3)


def test_a_checkpoint_of_another_run_is_refused_not_mixed_with_its_rows(tmp_path, capsys, corpus, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    base = ["--data", corpus, *SMALL, "--steps", 4, "--checkpoint-every", 2]
    assert train(capsys, *base, "--out", a)[0] == 0
    train_stopped_after(monkeypatch, capsys, 2, *base, "--out", b)
    shutil.copy(a / "checkpoint.pt", b / "checkpoint.pt")  # run a's, after its step 4
    metrics = (b / "metrics.jsonl").read_text()
    rc, err = train(capsys, "--resume", "--out", b)
    assert rc == 2 and err.count("\n") == 1, err
    assert f"{b / 'checkpoint.pt'} is a checkpoint of another run (run id " in err
    assert (b / "metrics.jsonl").read_text() == metrics and not (b / "run.json").exists()
    # run directories of an older fp8sim have no run ids: the rows must still cover the checkpoint
    ck = torch.load(b / "checkpoint.pt", weights_only=True)
    del ck["run_id"]
    torch.save(ck, b / "checkpoint.pt")
    rc, err = train(capsys, "--resume", "--out", b)
    assert rc == 2 and "metrics.jsonl holds steps 1..2 (2 rows) but" in err and "after step 4" in err, err
    assert (b / "metrics.jsonl").read_text() == metrics


def test_seeds_beyond_64_bits_are_refused_in_words(tmp_path, capsys, corpus):
    for argv in (["train", "--data", str(corpus), *SMALL, "--steps", "1", "--out", str(tmp_path / "r")],
                 ["demo", "--quick", "--out", str(tmp_path / "d")]):  # fmt: skip
        assert cli.main([*argv, "--seed", str(2**64)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--seed must be an integer from 0 to 2**64 - 1, got {2**64}" in err, err
    assert not (tmp_path / "r").exists() and not (tmp_path / "d").exists()


def test_a_custom_recipe_run_resumes_finishes_and_extends_from_python(tmp_path, corpus):
    """A run of a recipe object (stored as its to_dict(), which config.json cannot build back)
    resumes, stays finished, and extends from Python with the same object; another recipe
    object's checkpoint is refused as another config."""
    from fp8sim.recipes import get_recipe
    from fp8sim.training.model import GPTConfig
    from fp8sim.training.trainer import TrainConfig, Trainer

    model = GPTConfig(block_size=16, n_layer=1, n_head=1, n_embd=32)
    cfg = TrainConfig(recipe=get_recipe("te-delayed", amax_history_len=32), steps=4, batch_size=4, warmup=1,
                      eval_every=0, checkpoint_every=2, data=str(corpus), model=model)  # fmt: skip
    out = tmp_path / "run"
    Trainer(cfg, out).run(progress=False, stop_after=2)
    assert Trainer(cfg, out, resume=True).run(progress=False)["steps_done"] == 4
    assert Trainer(cfg, out, resume=True).finished
    assert Trainer(cfg.extended(6), out, resume=True).run(progress=False)["steps_done"] == 6
    other = TrainConfig(**{**cfg.__dict__, "recipe": get_recipe("te-delayed", amax_history_len=16), "steps": 8})
    with pytest.raises(ValueError, match=r"checkpoint was written by a different config \(differs in \['recipe'\]\)"):
        Trainer(other, out, resume=True)

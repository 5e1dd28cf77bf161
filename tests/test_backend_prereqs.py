"""The triton backend says what it needs, in words a user can act on, before anything runs."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fp8sim.backends import get


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU makes the backend usable")
def test_triton_without_gpu_or_interpreter_says_how(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        get("triton")


def test_triton_not_installed_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'fp8sim\[gpu\]'"):
        get("triton")


def test_the_interpreter_makes_it_usable_on_a_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # conftest sets it before triton's import
    assert get("triton").name == "triton"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU makes the backend usable")
def test_train_on_triton_checks_before_creating_its_run_directory(tmp_path, monkeypatch, capsys):
    from fp8sim import cli

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "run"
    rc = cli.main(["train", "--backend", "triton", "--recipe", "te-delayed", "--steps", "2", "--out", str(out)])
    assert rc == 2 and "TRITON_INTERPRET=1" in capsys.readouterr().err
    assert not out.exists()  # a corrected retry is not refused by a half-made run

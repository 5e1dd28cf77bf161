"""``fp8sim train --device``: where a run lives. CPU here; CUDA refused in one line when torch has
no GPU (the CUDA run itself: benchmarks/gpu_train_check.py on a GPU machine)."""

from __future__ import annotations

import json

import pytest
import torch

from fp8sim import cli
from tests.conftest import TINY_TRAIN as SMALL

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")


@no_gpu
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
@pytest.mark.parametrize("nproc", ["1", "2"])
def test_device_cuda_without_a_gpu_is_refused_before_out_is_created(tmp_path, capsys, device, nproc):
    out = tmp_path / "run"
    assert cli.main(["train", "--device", device, "--nproc", nproc, "--steps", "1", "--out", str(out), *SMALL]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"fp8sim train: error: --device {device}: no CUDA GPU is available to torch here "
                   f"(torch {torch.__version__}, torch.cuda.is_available() is False)"]
    assert not out.exists()


@pytest.mark.parametrize("device", ["tpu", "cuda:x", ""])
def test_a_device_that_is_not_cpu_or_cuda_is_refused_naming_the_flag(tmp_path, capsys, device):
    out = tmp_path / "run"
    assert cli.main(["train", "--device", device, "--steps", "1", "--out", str(out), *SMALL]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("fp8sim train: error: --device ") and not out.exists()


def test_device_cpu_is_the_default_run_bit_for_bit(tmp_path, capsys):
    runs = {}
    for name, extra in (("default", []), ("cpu", ["--device", "cpu"])):
        out = tmp_path / name
        assert cli.main(["train", "--recipe", "te-current", "--steps", "2", "--out", str(out), *SMALL, *extra]) == 0
        runs[name] = [json.loads(line)["loss"] for line in open(out / "metrics.jsonl")]
    capsys.readouterr()
    assert runs["cpu"] == runs["default"] and len(runs["cpu"]) == 2

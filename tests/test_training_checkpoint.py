"""Kill and resume reproduces the uninterrupted run bit for bit (CPU)."""

import json

import numpy as np
import pytest
import torch

from fp8sim.training.checkpoint import load_checkpoint, save_checkpoint
from fp8sim.training.model import GPTConfig
from fp8sim.training.trainer import TrainConfig, Trainer, read_metrics


pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture(scope="module")
def corpus(stdlib_corpus):
    return stdlib_corpus


def _cfg(recipe: str, **kw) -> TrainConfig:
    base = dict(recipe=recipe, steps=6, batch_size=4, warmup=2, eval_every=4, eval_batches=1,
                checkpoint_every=3, model=TINY)
    base.update(kw)
    return TrainConfig(**base)


def _losses(run_dir):
    return [(r["step"], r["loss"], r.get("val_loss")) for r in read_metrics(run_dir)]


@pytest.mark.parametrize("recipe", ["fp32", "bf16", "te-delayed"])
def test_kill_and_resume_bit_exact(tmp_path, corpus, recipe):
    cfg = _cfg(recipe)
    Trainer(cfg, tmp_path / "full", corpus=corpus).run(progress=False)
    full = _losses(tmp_path / "full")
    assert len(full) == 6 and full[-1][2] is not None and full[3][2] is not None

    # the "killed" run got to step 5; its last checkpoint is step 3, steps 4-5 are lost work
    Trainer(cfg, tmp_path / "cut", corpus=corpus).run(progress=False, stop_after=5)
    assert load_checkpoint(tmp_path / "cut")["step"] == 3
    torch.manual_seed(12345)  # a fresh process has other RNG state
    resumed = Trainer(cfg, tmp_path / "cut", corpus=corpus, resume=True)
    assert resumed.start_step == 3
    resumed.run(progress=False)
    assert _losses(tmp_path / "cut") == full  # exact float equality, val losses included
    sd_full = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True)["model"]
    sd_cut = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)["model"]
    # FP8 layers' _extra_state entries (their policies' states) are plain data
    assert all(torch.equal(sd_full[k], sd_cut[k]) if torch.is_tensor(sd_full[k]) else sd_full[k] == sd_cut[k]
               for k in sd_full)


def test_resume_rejects_other_config_and_existing_run(tmp_path, corpus):
    Trainer(_cfg("fp32", steps=3), tmp_path, corpus=corpus).run(progress=False)
    with pytest.raises(ValueError, match="lr"):
        Trainer(_cfg("fp32", steps=3, lr=1e-3), tmp_path, corpus=corpus, resume=True)
    with pytest.raises(ValueError, match="already holds a run"):
        Trainer(_cfg("fp32", steps=3), tmp_path, corpus=corpus)
    with pytest.raises(FileNotFoundError):
        Trainer(_cfg("fp32"), tmp_path / "nothing", corpus=corpus, resume=True)


def test_checkpoint_roundtrips_numpy_policy_state(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    pol = {"weight": {"history": np.array([1.5, 2.5], np.float32), "n": np.int64(4), "names": ["a"]}}
    save_checkpoint(tmp_path, step=7, model=model, optimizer=opt, policies=pol, config={"x": 1})
    ck = load_checkpoint(tmp_path)
    h = ck["policies"]["weight"]["history"]
    assert isinstance(h, np.ndarray) and h.dtype == np.float32 and h.tolist() == [1.5, 2.5]
    assert ck["policies"]["weight"]["n"] == 4 and ck["step"] == 7 and ck["config"] == {"x": 1}
    assert not list(tmp_path.glob("*.tmp*"))  # atomic write leaves no temp file


def test_metrics_rows_and_summary(tmp_path, corpus):
    cfg = _cfg("fp32", steps=4)
    summary = Trainer(cfg, tmp_path, corpus=corpus).run(progress=False)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["lr"] == pytest.approx(cfg.lr / 2) and rows[1]["lr"] == pytest.approx(cfg.lr)
    assert rows[-1]["lr"] == pytest.approx(cfg.lr * cfg.min_lr_ratio)
    assert all(r["tokens_per_s"] > 0 for r in rows)
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["final_loss"] == rows[-1]["loss"] == summary["final_loss"]
    mem = run["memory_bytes_per_param"]
    # float32 weights and grads: 4 bytes each; AdamW: two float32 moments (+ tiny step counters)
    assert mem["weights"] == 4.0 and mem["grads"] == 4.0
    assert 8.0 <= mem["optimizer"] < 8.01


def test_gemm_accumulation_is_part_of_the_run_config(tmp_path, corpus):
    """``gemm_accumulate`` reaches the FP8 linears; the emulator and torch backends agree bit for
    bit in each mode, and a run cannot be resumed under the other mode. (On this tiny model the
    float32 sums of E4M3 products are mostly exact, so the two modes' losses may coincide; the
    modes' GEMMs themselves are told apart in tests/test_backends.py.)"""
    losses = {}
    for mode in ("float32", "float64"):
        for backend in ("emulator", "torch"):
            cfg = _cfg("te-delayed", steps=3, eval_every=0, checkpoint_every=3, backend=backend, gemm_accumulate=mode)
            t = Trainer(cfg, tmp_path / f"{mode}-{backend}", corpus=corpus)
            assert t.fp8.gemm_accumulate == mode
            t.run(progress=False)
            losses[mode, backend] = [r["loss"] for r in read_metrics(tmp_path / f"{mode}-{backend}")]
        assert losses[mode, "emulator"] == losses[mode, "torch"]
    other = _cfg("te-delayed", steps=3, eval_every=0, checkpoint_every=3, backend="torch", gemm_accumulate="float32")
    with pytest.raises(ValueError, match="gemm_accumulate"):
        Trainer(other, tmp_path / "float64-torch", corpus=corpus, resume=True)
    with pytest.raises(ValueError, match="gemm_accumulate must be one of"):
        _cfg("te-delayed", gemm_accumulate="float16")

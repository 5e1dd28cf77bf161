"""Shared test setup.

Triton runs through its CPU interpreter unless a CUDA GPU is present; the variable must be set
before triton (or anything importing it) is imported, so it is set here, first.
"""

import errno
import os

import torch  # noqa: E402  (after os; torch does not import triton at import time)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".numba_cache"))

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch intra-op thread for a module's tests: on the tiny models one thread is faster
    than two fighting over a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def stdlib_corpus():
    """The default training corpus (the Python standard library's sources), cut to 200 kB."""
    from fp8sim.training.data import load_corpus

    return load_corpus(max_bytes=200_000)


def tiny_train_config(recipe: str, **overrides):
    """A TrainConfig of a 1-layer, 32-wide GPT on 32-byte blocks for the data-parallel tests:
    8 steps of 8 rows, no evaluation but at the end, 1 MiB of corpus. Importable by spawned ranks
    (``from tests.conftest import tiny_train_config``)."""
    from fp8sim.training.model import GPTConfig
    from fp8sim.training.trainer import TrainConfig

    base = dict(recipe=recipe, steps=8, batch_size=8, lr=1e-2, warmup=2, eval_every=0, eval_batches=1,
                checkpoint_every=0, max_bytes=2**20, model=GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32))
    return TrainConfig(**{**base, **overrides})


#: ``fp8sim train`` options of a tiny run (1 layer, 32 wide, 16-byte blocks, batch 4, no evaluation
#: but at the end): a step takes a fraction of a second
TINY_TRAIN = ["--n-layer", "1", "--n-embd", "32", "--n-head", "1", "--block-size", "16", "--batch-size", "4",
              "--warmup", "1", "--eval-every", "0"]  # fmt: skip


@pytest.fixture()
def corpus(tmp_path):
    """A 32 kB text corpus for ``fp8sim train --data``."""
    p = tmp_path / "corpus.txt"
    p.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(600)))
    return p


def train_stopped_after(monkeypatch, capsys, step: int, *argv) -> None:
    """``fp8sim train ARGV`` stopped after ``step`` as if killed there (checkpointed at the last
    multiple of --checkpoint-every, no run.json)."""
    from fp8sim import cli
    from fp8sim.training.trainer import Trainer

    real = Trainer.run
    with monkeypatch.context() as m:
        m.setattr(Trainer, "run", lambda self, **kw: real(self, **{**kw, "stop_after": step}))
        assert cli.main(["train", *[str(a) for a in argv], "--json"]) == 0
    capsys.readouterr()


class FullDisk:
    """A file object whose writes of more than ``over`` bytes stop half way with ENOSPC, as a
    full disk does (smaller writes go through)."""

    def __init__(self, f, over: int = 0):
        self._f, self._over = f, over

    def write(self, data):
        if len(data) <= self._over:
            return self._f.write(data)
        self._f.write(data[: len(data) // 2])
        self._f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

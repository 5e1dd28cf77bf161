"""Shared test setup.

Triton runs through its CPU interpreter unless a CUDA GPU is present; the variable must be set
before triton (or anything importing it) is imported, so it is set here, first.
"""

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

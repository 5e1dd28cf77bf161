"""Model shapes and gradients, byte corpus and deterministic batches."""

import numpy as np
import pytest
import torch

from fp8sim.training.data import default_corpus_files, get_batch, load_corpus
from fp8sim.training.model import GPT, GPTConfig


pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)


def test_gpt_shapes_loss_and_causality():
    torch.manual_seed(0)
    model = GPT(TINY)
    idx = torch.randint(0, 256, (3, 32))
    logits, loss = model(idx, torch.randint(0, 256, (3, 32)))
    assert logits.shape == (3, 32, 256)
    # initial loss is close to uniform over 256 bytes: ln 256 = 5.545
    assert abs(float(loss.detach()) - np.log(256)) < 0.1
    # causality: changing the last token changes no earlier logits
    idx2 = idx.clone()
    idx2[:, -1] = (idx2[:, -1] + 1) % 256
    logits2, _ = model(idx2)
    torch.testing.assert_close(logits[:, :-1], logits2[:, :-1], rtol=0, atol=0)
    assert not torch.equal(logits[:, -1], logits2[:, -1])


def test_gpt_weight_tying_and_param_count():
    model = GPT(TINY)
    assert model.lm_head.weight is model.wte.weight
    C, L = TINY.n_embd, TINY.n_layer
    per_block = (C * 3 * C + 3 * C) + (C * C + C) + (C * 4 * C + 4 * C) + (4 * C * C + C) + 4 * C
    expected = 256 * C + TINY.block_size * C + L * per_block + 2 * C
    assert model.num_params() == expected


def test_gpt_rejects_long_sequences_and_bad_config():
    with pytest.raises(ValueError, match="block_size"):
        GPT(TINY)(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="multiple of the number of heads"):
        GPTConfig(n_embd=30, n_head=4)


def test_default_corpus_is_stdlib_sources():
    files = default_corpus_files()
    import os

    names = {f.name for f in files}
    assert {"os.py", "random.py", "__init__.py"} <= names
    assert os.path.realpath(os.__file__) in {os.path.realpath(f) for f in files}
    assert all(not ({"site-packages", "test", "tests"} & set(f.parts)) for f in files)


def test_corpus_from_file_and_dir(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"B" * 3000)
    (tmp_path / "a.txt").write_bytes(b"A" * 1000)
    c = load_corpus(tmp_path, val_fraction=0.25)
    raw = bytes(torch.cat([c.train, c.val]).numpy())
    assert raw == b"A" * 1000 + b"\n" + b"B" * 3000  # sorted order, joined by one newline
    assert c.val.numel() == int(4001 * 0.25) and c.num_files == 2
    single = load_corpus(tmp_path / "b.txt", max_bytes=2000)
    assert single.num_bytes == 2000
    with pytest.raises(FileNotFoundError):
        load_corpus(tmp_path / "missing")
    with pytest.raises(ValueError, match="at least"):
        load_corpus(tmp_path / "a.txt", min_bytes=5000)


def test_batches_deterministic_and_shifted(tmp_path):
    rng = np.random.default_rng(1)
    (tmp_path / "x.bin").write_bytes(rng.integers(0, 256, 20000, dtype=np.uint8).tobytes())
    c = load_corpus(tmp_path / "x.bin")
    x1, y1 = get_batch(c, "train", 5, 4, 16, seed=3)
    x2, y2 = get_batch(c, "train", 5, 4, 16, seed=3)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == (4, 16) and x1.dtype == torch.int64
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the next bytes
    x3, _ = get_batch(c, "train", 6, 4, 16, seed=3)
    x4, _ = get_batch(c, "train", 5, 4, 16, seed=4)
    assert not torch.equal(x1, x3) and not torch.equal(x1, x4)
    # every window is a real slice of the train split
    train = c.train.long()
    for row in torch.cat([x1, y1[:, -1:]], 1):
        hits = [s for s in range(train.numel() - 16) if torch.equal(train[s : s + 17], row)]
        assert hits

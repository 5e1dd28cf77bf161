"""Byte corpus and deterministic batches.

The corpus is raw bytes: a file, every regular file under a directory (sorted by relative path),
or by default the Python standard library's own ``.py`` sources (always present, real text;
``site-packages`` and test suites excluded). Files are joined with a single ``\\n`` in sorted
path order, so the same tree always gives the same bytes.

Split: the first ``1 - val_fraction`` of the bytes train, the rest validate (a contiguous tail, so
no window straddles the two). Batch ``i`` of a run with seed ``s`` is a pure function of ``(s, i)``:
its window offsets come from a ``torch.Generator`` seeded with ``s`` mixed with ``i``. The data
position of a run is therefore its step counter, and resuming needs nothing else.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fp8sim.input_files import open_regular

__all__ = ["ByteCorpus", "load_corpus", "default_corpus_files", "get_batch"]

#: default cap on corpus size: enough text for the demo, quick to read
DEFAULT_MAX_BYTES = 16 * 2**20
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test"}


@dataclass(frozen=True)
class ByteCorpus:
    """Train and validation byte streams as uint8 tensors, plus where they came from."""

    train: torch.Tensor  # (N_train,) uint8
    val: torch.Tensor  # (N_val,) uint8
    source: str
    num_files: int

    @property
    def num_bytes(self) -> int:
        return int(self.train.numel() + self.val.numel())

    @functools.cached_property
    def fingerprint(self) -> str:
        """``"<bytes>:<crc32>"`` of the train and validation bytes: checkpoints keep it, so a
        resume on a corpus that changed meanwhile is refused instead of training on other data.
        Computed once (every checkpoint stores it)."""
        import zlib

        crc = zlib.crc32(self.val.numpy().tobytes(), zlib.crc32(self.train.numpy().tobytes()))
        return f"{self.num_bytes}:{crc:08x}"

    def check_block_size(self, block_size: int, splits: tuple[str, ...] = ("train", "val")) -> None:
        """ValueError unless every split in ``splits`` holds more than ``block_size + 1`` bytes
        (a batch needs ``block_size + 1`` consecutive bytes and a choice of where they start)."""
        for split in splits:
            data = self.train if split == "train" else self.val
            if data.numel() <= block_size + 1:
                raise ValueError(f"{split} split has {data.numel()} bytes, need more than block_size + 1 = "
                                 f"{block_size + 1}")


def default_corpus_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted by path relative to the stdlib root."""
    root = Path(sysconfig.get_paths().get("stdlib") or os.path.dirname(os.__file__))
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _dir_files(root: Path) -> list[Path]:
    """Every file under ``root`` but directories (FIFOs and sockets too: opening refuses them by
    name, as it should, rather than leaving them out unsaid)."""
    files = [p for p in root.rglob("*") if not p.is_dir()]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_corpus(
    data: str | os.PathLike | None = None,
    *,
    val_fraction: float = 0.1,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
    min_bytes: int = 1024,
) -> ByteCorpus:
    """Read a byte corpus and split it.

    Args:
        data: a file, a directory (all regular files under it), or None for the default corpus.
        val_fraction: share of the bytes (the tail) held out for validation, in (0, 0.5].
        max_bytes: stop reading after this many bytes (None: no cap).
        min_bytes: a corpus smaller than this is rejected (ValueError).
    """
    if not 0.0 < val_fraction <= 0.5:
        raise ValueError(f"val_fraction must be in (0, 0.5], got {val_fraction}")
    if data is None:
        files, source = default_corpus_files(), "python-stdlib"
    else:
        path = Path(data)
        if path.is_file():
            files = [path]
        elif path.is_dir():
            files = _dir_files(path)
        elif path.exists():  # a device, a pipe, a socket: not a corpus of bytes to split
            raise ValueError(f"--data {data}: not a regular file or a directory")
        else:
            raise FileNotFoundError(f"--data {data}: no such file or directory")
        source = str(path)
    chunks, total, used = [], 0, 0
    for f in files:
        if max_bytes is not None and total >= max_bytes:
            break
        with open_regular(f) as fh:  # a FIFO in a corpus directory: refused, never opened
            # no more than the cap still takes (joined by "\n"): a 2 GiB file costs 16 MiB
            blob = fh.read(-1 if max_bytes is None else max_bytes - total)
        if chunks:
            chunks.append(b"\n")
            total += 1
        chunks.append(blob)
        total += len(blob)
        used += 1
    raw = b"".join(chunks)
    if max_bytes is not None:
        raw = raw[:max_bytes]
    if len(raw) < min_bytes:
        raise ValueError(f"corpus {source}: {len(raw)} bytes, need at least {min_bytes}")
    arr = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())
    n_val = max(1, int(len(raw) * val_fraction))
    return ByteCorpus(train=arr[:-n_val], val=arr[-n_val:], source=source, num_files=used)


def _generator(seed: int, index: int, split: str) -> torch.Generator:
    # one independent stream per (seed, batch index, split); the mixing constants are arbitrary odd
    mix = (seed * 0x9E3779B1 + index * 0x85EBCA77 + (0 if split == "train" else 0xC2B2AE3D)) % (2**63)
    return torch.Generator().manual_seed(mix)


def get_batch(
    corpus: ByteCorpus, split: str, index: int, batch_size: int, block_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch number ``index`` of ``split``: inputs ``(B, T)`` and next-byte targets ``(B, T)``, int64.

    A pure function of its arguments: the same ``(seed, index)`` always gives the same batch.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    corpus.check_block_size(block_size, (split,))
    data = corpus.train if split == "train" else corpus.val
    starts = torch.randint(0, data.numel() - block_size - 1, (batch_size,), generator=_generator(seed, index, split))
    offsets = starts[:, None] + torch.arange(block_size + 1)  # (B, T + 1)
    window = data[offsets].long()
    return window[:, :-1], window[:, 1:]

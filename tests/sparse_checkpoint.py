"""Synthetic checkpoints of any apparent size as sparse safetensors files (for the memory tests
and benchmarks/bench_checkpoint_scale.py): the header and a few given tensors are written, the
rest of the data section is a hole (reads as zeros, takes no disk)."""

from __future__ import annotations

import json
import math
import os
import struct

import numpy as np

#: safetensors dtype -> bytes per element
ITEMSIZE = {"U8": 1, "F8_E4M3": 1, "F8_E8M0": 1, "BF16": 2, "F16": 2, "F32": 4}


def write_sparse_safetensors(path, entries) -> int:
    """Write ``entries`` (name, safetensors dtype, shape, bytes or None for zeros) as a
    safetensors file whose zero data are a hole; returns its apparent size in bytes."""
    header, offset = {}, 0
    for name, dtype, shape, _ in entries:
        n = math.prod(shape) * ITEMSIZE[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the data section 8-byte aligned, as safetensors writes it
    start = 8 + len(text)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name, _, _, data in entries:
            if data is not None:
                f.seek(start + header[name]["data_offsets"][0])
                f.write(data)
        f.truncate(start + offset)
    return start + offset


def nvfp4_entries(prefix: str, rows: int, cols: int) -> list:
    """A compressed-tensors NVFP4 weight of logical shape (rows, cols): packed codes and E4M3
    block scales zero, the global scale 1."""
    return [(f"{prefix}.weight_global_scale", "F32", (1,), np.float32([1.0]).tobytes()),
            (f"{prefix}.weight_scale", "F8_E4M3", (rows, -(-cols // 16)), None),
            (f"{prefix}.weight_packed", "U8", (rows, cols // 2), None)]  # fmt: skip


def fp8_block_entries(prefix: str, rows: int, cols: int) -> list:
    """A DeepSeek-style FP8 weight (rows, cols) with 128 x 128 float32 block scales of 1."""
    grid = (-(-rows // 128), -(-cols // 128))
    ones = np.ones(grid, np.float32).tobytes()
    return [(f"{prefix}.weight", "F8_E4M3", (rows, cols), None),
            (f"{prefix}.weight_scale_inv", "F32", grid, ones)]


def apparent_size(path) -> int:
    return os.stat(path).st_size

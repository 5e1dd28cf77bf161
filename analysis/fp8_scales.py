"""FP8 checkpoint tensors and their companion scales (``fp8sim analyze --fp8-scales``).

An FP8 checkpoint stores each quantized weight as FP8 codes plus a float tensor of scales that
dequantizes it: ``value = decode(code) * scale[group of the element]``. Two spellings of the
companion are recognised, both *multipliers* (dequantization scales):

* ``<name>_scale_inv``: DeepSeek-V3 and Hugging Face's FineGrainedFP8 checkpoints (block scales,
  usually 128 x 128; "inv" because it is the inverse of the quantization scale);
* ``<name>_scale``: compressed-tensors / vLLM / ModelOpt checkpoints (one scale for the whole
  tensor, or one per output row).

The groups follow from the shapes, for a weight ``(..., M, N)`` (leading dimensions, e.g. stacked
experts, must be the scale's leading dimensions too):

* a scale with one element: the whole tensor;
* ``(..., M)`` or ``(..., M, 1)``: one scale per row;
* ``(..., ceil(M / R), ceil(N / C))``: R x C blocks, the last ones ragged. R x C is ``--fp8-block``,
  else the checkpoint's ``config.json`` ``quantization_config.weight_block_size`` (in the file's
  directory), else 128 x 128.

Any other shape, a companion that is not a float tensor, or both spellings at once is refused in
one line naming both tensors. The companion is looked for in the weight's own file first, then
in the other files of its directory (a sharded checkpoint may put them in different shards).

Values: ``float32(decode(code) * float32(scale))``, the product rounded to nearest even in
float32 -- what a float32 dequantization (DeepSeek's ``weight_dequant``, ``q.float() * s``)
computes; the analysis casts float32 values anyway.

With ``--fp8-scales stored`` (the default) nothing is applied: the FP8 codes are analyzed as the
values they encode, and each FP8 tensor that has a companion gets a note saying so.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from analysis.dumps import FP8_DTYPES, Dump, TensorSource

__all__ = ["SCALE_SUFFIXES", "DEFAULT_BLOCK", "parse_block", "link_fp8_scales", "ScaledSource"]

#: companion-name suffixes, in the order they are looked for (both are multipliers)
SCALE_SUFFIXES = ("_scale_inv", "_scale")
#: block shape when neither --fp8-block nor a config.json gives one
DEFAULT_BLOCK = (128, 128)
_MAX_BLOCK = 1 << 31


def parse_block(spec: str) -> tuple[int, int]:
    """``"RxC"`` -> (R, C), both in [1, 2**31]. Raises ValueError naming the option."""
    parts = spec.lower().split("x")
    try:
        r, c = (int(p) for p in parts) if len(parts) == 2 else (None, None)
    except ValueError:
        r, c = None, None
    if r is None or not (1 <= r <= _MAX_BLOCK and 1 <= c <= _MAX_BLOCK):
        raise ValueError(f"--fp8-block {spec!r}: expected RxC with 1 <= R, C <= 2**31 (e.g. 128x128)")
    return r, c


def _config_block(directory: str, cache: dict[str, tuple[tuple[int, int], str] | None]):
    """(block, source) from ``config.json``'s ``quantization_config.weight_block_size`` in
    ``directory``, or None when there is no such entry (a config.json that is not JSON, or has no
    quantization config, is not ours to judge). A weight_block_size that is present but not two
    positive ints is refused."""
    if directory in cache:
        return cache[directory]
    found = None
    path = os.path.join(directory, "config.json")
    try:
        with open(path, "rb") as f:
            cfg = json.loads(f.read(1 << 22))
    except (OSError, ValueError, UnicodeDecodeError):
        cfg = None
    q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if isinstance(q, dict) and "weight_block_size" in q:
        wbs = q["weight_block_size"]
        ok = (isinstance(wbs, list) and len(wbs) == 2
              and all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= _MAX_BLOCK
                      for v in wbs))  # fmt: skip
        if not ok:
            raise ValueError(f"{path}: quantization_config.weight_block_size {wbs!r} is not two "
                             "positive ints (give --fp8-block RxC)")  # fmt: skip
        found = ((wbs[0], wbs[1]), "config.json")
    cache[directory] = found
    return found


@dataclass
class ScaledSource(TensorSource):
    """An FP8 tensor read as its dequantized values: ``float32(decode(code) * scale)`` (see the
    module docstring). ``scale`` holds the companion's values (float32, flat), ``kind`` is
    ``tensor``, ``row`` or ``block``, ``block`` the R x C of block scales, ``scale_name`` the
    companion's name and ``described`` a line for reports."""

    base: TensorSource = field(repr=False, default=None)
    scale: np.ndarray = field(repr=False, default=None)
    kind: str = "tensor"
    block: tuple[int, int] = (1, 1)
    scale_name: str = ""
    described: str = ""

    def read(self, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` of the flat C-order tensor, dequantized (float32)."""
        codes = self.base.read(start, stop)
        if codes.size == 0:
            return codes
        return codes * self.scale[self._groups(max(0, int(start)), codes.size)]  # float32 RNE

    def _groups(self, start: int, size: int) -> np.ndarray:
        """Index into ``scale`` of each element ``start .. start + size - 1``."""
        if self.kind == "tensor":
            return np.zeros(size, np.int64)
        m, n = self.shape[-2], self.shape[-1]
        idx = np.arange(start, start + size, dtype=np.int64)
        rows = idx // n  # over the leading dimensions too: lead * M + i
        if self.kind == "row":
            return rows
        r, c = self.block
        lead, i = np.divmod(rows, m)
        gr, gc = -(-m // r), -(-n // c)
        return (lead * gr + i // r) * gc + (idx - rows * n) // c


def _scale_kind(w_shape: tuple[int, ...], s_shape: tuple[int, ...], block: tuple[int, int]):
    """'tensor', 'row' or 'block' for a scale of shape ``s_shape`` on a weight of ``w_shape``, or
    None when it fits none of them."""
    if math.prod(s_shape) == 1:
        return "tensor"
    if len(w_shape) < 2:
        return None
    lead, (m, n) = w_shape[:-2], w_shape[-2:]
    if s_shape in (lead + (m,), lead + (m, 1)):
        return "row"
    r, c = block
    if s_shape == lead + (-(-m // r), -(-n // c)):
        return "block"
    return None


def _find_companion(src: TensorSource, dump: Dump, in_file: dict[str, TensorSource],
                    in_dir: dict[str, list[tuple[Dump, TensorSource]]]):
    """(owner dump, companion source) of an FP8 tensor, from its own file (``in_file``: that
    file's tensors by name) first, then from the other files of its directory (``in_dir``: their
    tensors by name); None if it has none. Raises ValueError if both spellings exist, or the
    companion appears in several other files."""
    own = [(dump, in_file[src.name + sfx]) for sfx in SCALE_SUFFIXES if src.name + sfx in in_file]
    other = [(d, t) for sfx in SCALE_SUFFIXES for d, t in in_dir.get(src.name + sfx, ())
             if d is not dump]  # fmt: skip
    for hits in (own, other):
        if len({t.name for _, t in hits}) > 1:
            raise ValueError(f"{src.file}: {src.name} has both {src.name}_scale_inv and "
                             f"{src.name}_scale: which one dequantizes it is ambiguous")  # fmt: skip
        if len(hits) > 1:
            raise ValueError(f"{src.file}: {src.name}: its companion {hits[0][1].name} is in "
                             f"several files ({', '.join(t.file for _, t in hits)})")  # fmt: skip
        if hits:
            return hits[0]
    return None


def link_fp8_scales(dumps: list[Dump], mode: str, block: tuple[int, int] | None,
                    on_error: Callable[[str, ValueError], None]) -> list[dict]:
    """Pair every FP8 tensor of ``dumps`` (trace dumps aside) with its companion scale.

    mode ``stored``: nothing changes; returns a note per FP8 tensor that has a companion.
    mode ``apply``: each such tensor is replaced, in its dump, by a :class:`ScaledSource`, and
    the companion leaves its dump (it is not analyzed as a tensor of its own); returns a note per
    pair. ``block``: the R x C of block scales (None: config.json, else :data:`DEFAULT_BLOCK`).
    Notes are dicts ``file, name, note``. A companion whose shape fits no grouping, that is not
    a float tensor, or that is ambiguous makes its weight's file bad: ``on_error(path, error)``
    (one line naming the tensors) is called, which may raise; if it returns, the file is left
    out of ``dumps`` (in place).
    """
    if mode not in ("stored", "apply"):
        raise ValueError(f"--fp8-scales {mode!r}: valid: stored, apply")
    files = [d for d in dumps if d.trace is None]
    by_dir: dict[str, dict[str, list[tuple[Dump, TensorSource]]]] = {}
    for d in files:
        names = by_dir.setdefault(os.path.dirname(os.path.abspath(d.path)), {})
        for t in d.tensors:
            if t.name.endswith(SCALE_SUFFIXES):
                names.setdefault(t.name, []).append((d, t))
    config_cache: dict[str, Any] = {}
    notes: list[dict] = []
    used: dict[int, tuple[Dump, TensorSource]] = {}
    bad: set[int] = set()
    for dump in files:
        in_file = {t.name: t for t in dump.tensors}
        in_dir = by_dir[os.path.dirname(os.path.abspath(dump.path))]
        for k, src in enumerate(dump.tensors):
            if src.dtype not in FP8_DTYPES or src.name.endswith(SCALE_SUFFIXES):
                continue
            try:
                note = _link_one(dump, k, src, in_file, in_dir, mode, block, config_cache, used)
            except ValueError as exc:
                on_error(dump.path, exc)
                bad.add(id(dump))
                break
            if note:
                notes.append({"file": dump.path, "name": src.name, "note": note})
    gone = {id(comp) for _, comp in used.values()}
    for owner in {id(o): o for o, _ in used.values()}.values():
        owner.tensors = [t for t in owner.tensors if id(t) not in gone]
    dumps[:] = [d for d in dumps if id(d) not in bad]
    return notes


def _link_one(dump, k, src, in_file, in_dir, mode, block, config_cache, used) -> str | None:
    """:func:`link_fp8_scales` for the FP8 tensor ``dump.tensors[k]``: its note (or None)."""
    found = _find_companion(src, dump, in_file, in_dir)
    if found is None:
        return (f"FP8 codes analyzed as stored (no companion {src.name}_scale_inv or "
                f"{src.name}_scale)") if mode == "apply" else None  # fmt: skip
    owner, comp = found
    if mode == "stored":
        return (f"FP8 codes analyzed as stored; its companion {comp.name} was not applied "
                "(--fp8-scales apply analyzes the dequantized values)")  # fmt: skip
    if not comp.is_float or comp.dtype in FP8_DTYPES:
        raise ValueError(f"{comp.file}: {comp.name} (companion of {src.name}) has dtype "
                         f"{comp.dtype}; a scale must be float16/bfloat16/float32/float64")  # fmt: skip
    if block is not None:
        blk, origin = block, "--fp8-block"
    else:
        blk, origin = (_config_block(os.path.dirname(os.path.abspath(dump.path)), config_cache)
                       or (DEFAULT_BLOCK, "default"))  # fmt: skip
    kind = _scale_kind(tuple(src.shape), tuple(comp.shape), blk)
    if kind is None:
        raise ValueError(
            f"{comp.file}: {comp.name} shape {list(comp.shape)} does not fit {src.name} shape "
            f"{list(src.shape)}: expected one element, one per row {list(src.shape[:-1])}, or "
            f"{blk[0]}x{blk[1]} blocks ({origin}; --fp8-block RxC sets it)"
        )
    scale = comp.read_all().astype(np.float32).reshape(-1)
    what = {"tensor": "one scale for the tensor", "row": "one scale per row",
            "block": f"{blk[0]}x{blk[1]} block scales ({origin})"}[kind]  # fmt: skip
    dump.tensors[k] = ScaledSource(
        src.name, src.file, src.shape, src.dtype, src._read_raw, base=src, scale=scale, kind=kind,
        block=blk, scale_name=comp.name, described=f"{comp.name}: {what}",
    )  # fmt: skip
    used[id(comp)] = (owner, comp)
    return f"dequantized with {comp.name}: {what}"

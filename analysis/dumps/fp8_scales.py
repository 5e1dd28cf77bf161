"""FP8 checkpoint tensors and their companion scales (``fp8sim analyze --fp8-scales``).

An FP8 checkpoint stores each quantized weight as FP8 codes plus a tensor of scales that
dequantizes it: ``value = decode(code) * scale[group of the element]``. Two spellings of the
companion are recognised, both *multipliers* (dequantization scales):

* ``<name>_scale_inv``: DeepSeek-V3 and Hugging Face's FineGrainedFP8 checkpoints (block scales,
  usually 128 x 128; "inv" because it is the inverse of the quantization scale);
* ``<name>_scale``: compressed-tensors / vLLM / ModelOpt checkpoints (one scale for the whole
  tensor, one per output row, or blocks).

Where the companion is looked for: in the weight's own file; for a shard of a sharded checkpoint
(``model-00001-of-00003.safetensors``) also in the shard that the checkpoint's index
(``model.safetensors.index.json``, ``weight_map``) names for it, or without an index in the other
shards of the same set, opened for that if they were not given. Never in an unrelated file.

The groups follow from the shapes, for a weight ``(..., M, N)`` (leading dimensions, e.g. stacked
experts, must be the scale's leading dimensions too):

* a scale with one element: the whole tensor (also for a 1-D weight);
* ``(..., M)`` or ``(..., M, 1)``: one scale per row (a 1-D scale on a square weight is read
  this way, and the note says so);
* ``(..., ceil(M / R), ceil(N / C))``: R x C blocks, the last ones ragged. R x C is ``--fp8-block``,
  else what the checkpoint's ``config.json`` (in the weight's directory) declares --
  ``quantization_config.weight_block_size`` (FineGrainedFP8), or the compressed-tensors
  ``config_groups.*.weights`` ``block_structure`` (strategy ``block``) or ``group_size``
  (strategy ``group``: 1 x G); of several declared shapes, the one whose grid is the scale's
  shape -- else 128 x 128.

Refused, in one line naming both tensors (the weight's file counts as bad, exit 2): a shape that
fits none of these (or several declared block shapes), a companion that is not a float tensor
(float16/bfloat16/float32/float64, an FP8 format or E8M0), both spellings at once, a companion
found in several files, an index naming a file that is not in its directory; and a companion
that is expected but cannot be looked at, in one line naming the shard or the index entry: an
index entry for it naming a shard that cannot be read or does not hold it (a stale index, the
weight's own file included), or, without an index, a shard of the set that cannot be read or is
missing (it may be there). "No companion" (the codes analyzed as stored, with a note) is said
only where none can be: no shard set, or the index names none, or every shard of the set was
searched. Companion entries a dump could not read as tensors are named with their reason.

Values: ``decode(code) * scale`` computed as torch's ``q.float() * s`` computes it: in float32,
rounded to nearest even, for float32/bfloat16/float16/FP8/E8M0 scales; in float64 for float64
scales with a dimension (a 0-dim float64 scale is cast to float32, as torch does). Scales that are NaN, inf, zero or negative are applied as they are, and the note counts
them.

With ``--scales stored`` (the default; ``--fp8-scales`` is the same option) nothing is applied
or refused: the FP8 codes are analyzed as the values they encode, and each FP8 tensor that has a
companion gets a note.

Packed NVFP4 weights (uint8, with an E4M3 block scale and a float32 per-tensor scale, as
compressed-tensors and ModelOpt store them) are linked here too, by the rules of
:mod:`.fp4_scales`: ``apply`` reads them as their dequantized float32 values, ``stored`` leaves
them skipped (uint8) with a note.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from fp8sim.analysis.dumps.core import FLOAT_DTYPES, FP8_DTYPES, Dump, TensorSource
from fp8sim.analysis.dumps.fp8_companions import SCALE_SUFFIXES, CompanionFinder, config_blocks
from fp8sim.analysis.dumps.fp8_companions import parse_block
from fp8sim.analysis.dumps.fp4_scales import (E2M1_DTYPE, PackedE2M1, nvfp4_block_factors,
                                              nvfp4_companions)  # fmt: skip
from fp8sim.nvfp4 import NVFP4_BLOCK

__all__ = ["SCALE_SUFFIXES", "DEFAULT_BLOCK", "parse_block", "link_fp8_scales", "ScaledSource"]

#: block shape when neither --fp8-block nor a config.json gives one
DEFAULT_BLOCK = (128, 128)
_E8M0 = "float8_e8m0fnu"
#: uint8 tensors looked at as packed NVFP4 weights (compressed-tensors', ModelOpt's names)
_FP4_NAMES = ("weight_packed", "weight")


@dataclass
class ScaledSource(TensorSource):
    """An FP8 tensor read as its dequantized values (see the module docstring). ``scale`` holds
    the companion's values (float32, or float64 for a float64 companion), as a
    (groups along the leading dims and rows, column groups) grid; ``kind`` is ``tensor``,
    ``row`` or ``block``, ``block`` the R x C of the groups (rows: 1 x N), ``described`` a line
    for reports. An NVFP4 weight's ``base`` is its :class:`~.fp4_scales.PackedE2M1` values and
    its dtype ``float4_e2m1fn``."""

    base: TensorSource = field(repr=False, default=None)
    scale: np.ndarray = field(repr=False, default=None)
    kind: str = "tensor"
    block: tuple[int, int] = (1, 1)
    scale_name: str = ""
    described: str = ""

    @property
    def is_float(self) -> bool:
        return self.base.is_float

    def read(self, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` of the flat C-order tensor, dequantized."""
        codes = self.base.read(start, stop)
        if codes.size == 0:
            return codes.astype(self.scale.dtype)
        with np.errstate(over="ignore", invalid="ignore"):  # inf / NaN products are figures
            if self.kind == "tensor":  # (overflow, NaN counts), not warnings
                return codes * self.scale.reshape(-1)[0]
            return codes * self._scales(max(0, int(start)), codes.size)

    def _scales(self, start: int, size: int) -> np.ndarray:
        """The scale of each element ``start .. start + size - 1``. The chunk is a run of row
        pieces, each a run of column-group pieces: the per-element scales are ``np.repeat`` of
        one value per piece, the pieces counted from the columns each row piece covers (work
        and memory in proportion to the chunk, not to the width of its rows)."""
        m, n = (self.shape[-2], self.shape[-1]) if len(self.shape) >= 2 else (1, self.shape[-1])
        r, c = self.block
        r0, r1 = start // n, (start + size - 1) // n  # rows over the leading dims: lead * m + i
        rows = np.arange(r0, r1 + 1, dtype=np.int64)
        lead, i = np.divmod(rows, m)
        grid_rows = lead * (-(-m // r)) + i // r
        lo = np.zeros(rows.size, np.int64)  # the columns [lo, hi) of each row in the chunk
        hi = np.full(rows.size, n, np.int64)
        lo[0] = start - r0 * n
        hi[-1] = start + size - r1 * n
        first, end = lo // c, -(-hi // c)  # the column groups each row piece touches
        per_row = end - first
        row = np.repeat(np.arange(rows.size), per_row)
        group = first[row] + np.arange(row.size) - np.repeat(np.cumsum(per_row) - per_row, per_row)
        counts = np.minimum((group + 1) * c, hi[row]) - np.maximum(group * c, lo[row])
        return np.repeat(self.scale[grid_rows[row], group], counts)


def _scale_kind(w_shape: tuple[int, ...], s_shape: tuple[int, ...], blocks_of: Callable[[], Any]):
    """(kind, block, origin) of a scale of shape ``s_shape`` on a weight of ``w_shape``, or
    (None, why) when it fits no grouping. ``blocks_of()`` gives the candidate (block, origin)
    pairs, asked only for block scales: the one whose grid is ``s_shape`` is taken; none or
    several is (None, why)."""
    if math.prod(s_shape) == 1:
        return "tensor", (1, 1), ""
    if len(w_shape) < 2:
        return None, "a 1-D weight takes one scale (one element)"
    lead, (m, n) = w_shape[:-2], w_shape[-2:]
    if s_shape in (lead + (m,), lead + (m, 1)):
        return "row", (1, n), ""
    candidates = blocks_of()
    grids = [lead + (-(-m // r), -(-n // c)) for (r, c), _ in candidates]
    fits = [cand for cand, g in zip(candidates, grids) if g == s_shape]
    if len(fits) == 1:
        return "block", fits[0][0], fits[0][1]
    origin = candidates[0][1]
    hint = origin if origin == "--fp8-block" else f"{origin}; --fp8-block RxC sets it"
    shown = ", ".join(f"{r}x{c} blocks {list(g)}" for ((r, c), _), g in zip(candidates, grids))
    if fits:
        return None, f"it fits several block shapes ({shown}; {hint})"
    return None, f"expected one element, one per row {list(lead + (m,))}, or {shown} ({hint})"


def _scale_values(comp: TensorSource) -> np.ndarray:
    """The companion's values, float32 (float64 for a float64 companion with a dimension), in
    its shape."""
    if comp.dtype == _E8M0:
        from fp8sim.emulator import decode_table

        codes = np.asarray(comp.read_raw(0, comp.numel)).view(np.uint8)
        return decode_table("e8m0", np.float32)[codes].reshape(comp.shape)
    v = comp.read_all()
    # torch's q.float() * s: float64 for a float64 scale, but a 0-dim one is cast to float32
    return v if v.dtype == np.float64 and comp.shape != () else v.astype(np.float32)


def link_fp8_scales(dumps: list[Dump], mode: str, block: tuple[int, int] | None,
                    on_error: Callable[[str, ValueError], None]) -> list[dict]:
    """Pair every FP8 tensor of ``dumps`` (traces aside) with its companion scale.

    mode ``stored``: nothing changes; returns a note per FP8 tensor that has a companion (or an
    ambiguous one). mode ``apply``: each such tensor is replaced, in its dump, by a
    :class:`ScaledSource`, and a companion taken from a dump being analyzed leaves it (it is not
    analyzed on its own); returns a note per FP8 tensor. ``block``: R x C of block scales (None:
    config.json, else :data:`DEFAULT_BLOCK`). Notes are dicts ``file, name, note``. A refused
    companion (see the module docstring) makes the weight's file bad: ``on_error(path, error)``
    is called (it may raise); if it returns, that file leaves ``dumps`` (in place) with its
    notes, and the companions it would have taken stay where they are.
    """
    if mode not in ("stored", "apply"):
        raise ValueError(f"--scales {mode!r}: valid: stored, apply")
    files = [d for d in dumps if d.trace is None]
    finder = CompanionFinder(files)
    configs: dict[str, tuple[list[tuple[int, int]], str]] = {}
    notes: list[dict] = []
    taken: list[tuple[Dump, TensorSource]] = []
    bad: set[int] = set()
    for dump in files:
        try:
            dump_notes, dump_taken = _link_dump(dump, mode, block, finder, configs)
        except ValueError as exc:
            on_error(dump.path, exc)
            bad.add(id(dump))
            continue
        notes += dump_notes
        taken += dump_taken
    # a companion taken is not analyzed: no note of its own either (an FP8 companion's)
    names_taken = {(owner.path, comp.name) for owner, comp in taken}
    notes = [n for n in notes if (n["file"], n["name"]) not in names_taken]
    gone = {id(comp) for _, comp in taken}
    for owner in {id(o): o for o, _ in taken}.values():
        owner.tensors = [t for t in owner.tensors if id(t) not in gone]
    dumps[:] = [d for d in dumps if id(d) not in bad]
    return notes


def _link_dump(dump: Dump, mode: str, block, finder: CompanionFinder, configs: dict):
    """:func:`link_fp8_scales` for one file: (notes, [(owner, companion taken)])."""
    notes, taken = [], []

    def note(src: TensorSource, text: str) -> None:
        notes.append({"file": dump.path, "name": src.name, "note": text})

    for k, src in enumerate(dump.tensors):
        if src.dtype == "uint8" and src.name.endswith(_FP4_NAMES):
            found = _link_nvfp4(dump, k, src, mode, finder, note)
            if found is not None:
                taken += found
            continue
        if src.dtype not in FP8_DTYPES:
            continue
        if mode == "stored":
            try:
                found = finder.find(src, dump)
            except ValueError as exc:
                note(src, f"FP8 codes analyzed as stored; it {exc}")
                continue
            if found is not None:
                cname = found[1].name if isinstance(found[1], TensorSource) else found[1][0]
                note(src, f"FP8 codes analyzed as stored; its companion {cname} was not applied "
                          "(--scales apply analyzes the dequantized values)")  # fmt: skip
            continue
        try:
            found = finder.find(src, dump)
        except ValueError as exc:
            raise ValueError(f"{src.file}: {src.name} {exc}") from None
        if found is None:
            note(src, f"FP8 codes analyzed as stored (no companion {src.name}_scale_inv or "
                      f"{src.name}_scale)")  # fmt: skip
            continue
        owner, comp = found
        if not isinstance(comp, TensorSource):
            raise ValueError(f"{owner.path}: {comp[0]} (companion of {src.name}) cannot be used: "
                             f"{comp[1]}")  # fmt: skip
        if comp.dtype not in FLOAT_DTYPES and comp.dtype != _E8M0:
            raise ValueError(f"{comp.file}: {comp.name} (companion of {src.name}) has dtype "
                             f"{comp.dtype}; a scale must be a float, FP8 or E8M0 tensor")  # fmt: skip

        def blocks_of():
            if block is not None:
                return [(block, "--fp8-block")]
            if dump.kind == "memory":  # tensors in memory have no directory, so no config.json
                return [(DEFAULT_BLOCK, "default")]
            d = os.path.dirname(os.path.abspath(dump.path))
            if d not in configs:
                configs[d] = config_blocks(d)
            declared, remark = configs[d]
            if declared:
                return [(b, "config.json") for b in declared]
            return [(DEFAULT_BLOCK, "default" + (f"; {remark}" if remark else ""))]

        kind, *rest = _scale_kind(tuple(src.shape), tuple(comp.shape), blocks_of)
        if kind is None:
            raise ValueError(f"{comp.file}: {comp.name} shape {list(comp.shape)} does not fit "
                             f"{src.name} shape {list(src.shape)}: {rest[0]}")  # fmt: skip
        blk, origin = rest
        values = _scale_values(comp)
        what = {"tensor": "one scale for the tensor", "row": "one scale per row",
                "block": f"{blk[0]}x{blk[1]} block scales ({origin})"}[kind]  # fmt: skip
        if kind == "row" and len(comp.shape) < len(src.shape) and src.shape[-1] == src.shape[-2]:
            what += ", a 1-D scale on a square weight read as per row"
        where = "" if owner is dump else f" (in {owner.path})"
        n_bad = int((~np.isfinite(values)).sum())
        n_nonpos = int((values <= 0).sum())
        if n_bad or n_nonpos:
            what += f"; it holds {n_bad} NaN/inf and {n_nonpos} zero or negative scales"
        # (grid rows, column groups): rows over the leading dims
        grid = values.reshape(-1, values.shape[-1] if kind == "block" else 1)
        dump.tensors[k] = ScaledSource(
            src.name, src.file, src.shape, src.dtype, src.read_raw, base=src, scale=grid, kind=kind,
            block=blk, scale_name=comp.name, described=f"{comp.name}{where}: {what}",
        )  # fmt: skip
        taken.append((owner, comp))
        note(src, f"dequantized with {comp.name}{where}: {what}")
    return notes, taken


def _link_nvfp4(dump: Dump, k: int, src: TensorSource, mode: str, finder: CompanionFinder,
                note: Callable[[TensorSource, str], None]) -> list | None:  # fmt: skip
    """A uint8 tensor that may be a packed NVFP4 weight (:mod:`.fp4_scales`): under ``apply``
    replaced in ``dump`` by a :class:`ScaledSource` of its dequantized values; returns the
    companions taken ([(owner, source)]) or None."""
    try:
        found = nvfp4_companions(src, dump, finder)
    except ValueError as exc:
        if mode == "stored":
            note(src, f"uint8 tensor skipped; it {exc}")
            return None
        raise ValueError(f"{src.file}: {src.name} {exc}") from None
    if found is None:
        return None
    if isinstance(found, str):
        note(src, found)
        return None
    if mode == "stored":
        note(src, f"packed NVFP4 weight ({found.library}) skipped as uint8; --scales apply "
                  f"dequantizes it with {found.names}")  # fmt: skip
        return None
    try:
        shape, grid = nvfp4_block_factors(src, found)
    except ValueError as exc:
        raise ValueError(f"{src.file}: {src.name} {exc}") from None
    rule = "scale / global_scale" if found.library == "compressed-tensors" else "scale * scale_2"
    what = f"NVFP4 ({found.library}): E2M1 codes x float32({rule}), 1x16 E4M3 block scales"
    where = {o.path for o in (found.block_owner, found.tensor_owner) if o is not dump}
    if where:
        what += f" (in {', '.join(sorted(where))})"
    n_bad, n_nonpos = int((~np.isfinite(grid)).sum()), int((grid <= 0).sum())
    if n_bad or n_nonpos:
        what += f"; {n_bad} NaN/inf and {n_nonpos} zero or negative block factors"
    codes = PackedE2M1(src.name, src.file, shape, E2M1_DTYPE, None, base=src)
    dump.tensors[k] = ScaledSource(
        src.name, src.file, shape, E2M1_DTYPE, None, base=codes, scale=grid, kind="block",
        block=(1, NVFP4_BLOCK), scale_name=found.block.name,
        described=f"{found.names}: {what}",
    )  # fmt: skip
    note(src, f"dequantized with {found.names}: {what}")
    return [(found.block_owner, found.block), (found.tensor_owner, found.tensor)]

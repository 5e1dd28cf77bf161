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
* E8M0 exponents (uint8, as MX checkpoints store them, or ``F8_E8M0``) of shape ``(..., M,
  N / 32)``: MXFP8, one per 32 elements along the last axis (``N`` a multiple of 32: a uint8
  scale of any other shape is refused);
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
compressed-tensors and ModelOpt store them) and MX weights (packed MXFP4/MXFP6, gpt-oss blocks, or
FP8 with a uint8/E8M0 scale per 32 elements: MXFP8) are linked here too, by the rules of
:mod:`.fp4_scales` and :mod:`.mx_scales`: ``apply`` reads them as their dequantized float32
values, ``stored`` leaves them skipped (uint8) or as FP8 codes, with a note.

Memory: a companion's factors are decoded from its file per chunk of the tensor it scales
(:mod:`.scale_grids`), never loaded whole; linking reads each grid once, in order, to count its
NaN/inf, non-positive and E8M0 NaN factors for the note.
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
from fp8sim.analysis.dumps.fp4_scales import E2M1_DTYPE, PackedE2M1, nvfp4_companions, nvfp4_grid
from fp8sim.analysis.dumps.mx_scales import E8M0_DTYPES, MX_BLOCK, MXWeight, mx_grid_shape, mx_packed
from fp8sim.analysis.dumps.scale_grids import GridCensus, ScaleGrid, companion_grid
from fp8sim.nvfp4 import NVFP4_BLOCK

__all__ = ["SCALE_SUFFIXES", "DEFAULT_BLOCK", "parse_block", "link_fp8_scales", "ScaledSource"]

#: block shape when neither --fp8-block nor a config.json gives one
DEFAULT_BLOCK = (128, 128)


@dataclass
class ScaledSource(TensorSource):
    """A quantized tensor read as its dequantized values (see the module docstring). ``grid``
    holds the factors (a :class:`~.scale_grids.ScaleGrid` of float32, or float64 for a float64
    companion: rows over the leading dims and row groups, column groups), read per chunk, never
    whole; ``kind`` is ``tensor``, ``row`` or ``block``, ``block`` the R x C of the groups (rows:
    1 x N), ``described`` a line for reports. A packed weight's ``base`` is its element values
    (:class:`~.fp4_scales.PackedE2M1`, :class:`~.mx_scales.PackedE2M3`) and its dtype theirs."""

    base: TensorSource = field(repr=False, default=None)
    grid: ScaleGrid = field(repr=False, default=None)
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
            return codes.astype(self.grid.dtype)
        with np.errstate(over="ignore", invalid="ignore"):  # inf / NaN products are figures
            if self.kind == "tensor":  # (overflow, NaN counts), not warnings
                return codes * self.grid.read(0, 1)[0]
            return codes * self._scales(max(0, int(start)), codes.size)

    def _scales(self, start: int, size: int) -> np.ndarray:
        """The scale of each element ``start .. start + size - 1``. The chunk is a run of row
        pieces, each a run of column-group pieces: the per-element scales are ``np.repeat`` of
        one value per piece, the pieces counted from the columns each row piece covers, their
        values read from the grid range the chunk touches (work and memory in proportion to the
        chunk, not to the width of its rows nor to the grid)."""
        m, n = (self.shape[-2], self.shape[-1]) if len(self.shape) >= 2 else (1, self.shape[-1])
        r, c = self.block
        gc = -(-n // c)
        r0, r1 = start // n, (start + size - 1) // n  # rows over the leading dims: lead * m + i
        rows = np.arange(r0, r1 + 1, dtype=np.int64)
        lead, i = np.divmod(rows, m)
        grid_rows = lead * (-(-m // r)) + i // r
        lo = np.zeros(rows.size, np.int64)  # the columns [lo, hi) of each row in the chunk
        hi = np.full(rows.size, n, np.int64)
        lo[0] = start - r0 * n
        hi[-1] = start + size - r1 * n
        first, end = lo // c, -(-hi // c)  # the column groups each row piece touches
        # the flat grid range: exact where grid order is element order (one row, or 1 x C
        # groups), else whole grid rows (R x C blocks share a grid row across element rows)
        exact = r == 1 or r0 == r1
        g_lo = int(grid_rows[0]) * gc + (int(first[0]) if exact else 0)
        g_hi = int(grid_rows[-1]) * gc + (int(end[-1]) if exact else gc)
        values = self.grid.read(g_lo, g_hi)
        per_row = end - first
        row = np.repeat(np.arange(rows.size), per_row)
        group = first[row] + np.arange(row.size) - np.repeat(np.cumsum(per_row) - per_row, per_row)
        counts = np.minimum((group + 1) * c, hi[row]) - np.maximum(group * c, lo[row])
        return np.repeat(values[grid_rows[row] * gc + group - g_lo], counts)


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


def link_fp8_scales(dumps: list[Dump], mode: str, block: tuple[int, int] | None,
                    on_error: Callable[[str, ValueError], None], *,
                    census: bool = True) -> list[dict]:
    """Pair every FP8 tensor of ``dumps`` (traces aside) with its companion scale.

    mode ``stored``: nothing changes; returns a note per FP8 tensor that has a companion (or an
    ambiguous one). mode ``apply``: each such tensor is replaced, in its dump, by a
    :class:`ScaledSource`, and a companion taken from a dump being analyzed leaves it (it is not
    analyzed on its own); returns a note per FP8 tensor. ``block``: R x C of block scales (None:
    config.json, else :data:`DEFAULT_BLOCK`). Notes are dicts ``file, name, note``. ``census``:
    read each scale grid once to count its NaN/inf, non-positive and E8M0 NaN factors for the
    notes (False: not read; a worker process linking a file the caller linked already). A refused
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
            dump_notes, dump_taken = _link_dump(dump, mode, block, finder, configs, census)
        except ValueError as exc:
            on_error(dump.path, exc)
            bad.add(id(dump))
            continue
        notes += dump_notes
        taken += dump_taken
    if mode == "apply":  # companions of weights in shards not given leave the files given too
        taken += _taken_by_other_shards(files, bad, finder, block, configs)
    # a companion taken is not analyzed: no note of its own either (an FP8 companion's)
    names_taken = {(owner.path, comp.name) for owner, comp in taken}
    notes = [n for n in notes if (n["file"], n["name"]) not in names_taken]
    gone = {id(comp) for _, comp in taken}
    for owner in {id(o): o for o, _ in taken}.values():
        owner.tensors = [t for t in owner.tensors if id(t) not in gone]
    dumps[:] = [d for d in dumps if id(d) not in bad]
    return notes


def _taken_by_other_shards(files: list[Dump], bad: set[int], finder: CompanionFinder, block,
                           configs: dict) -> list[tuple[Dump, TensorSource]]:
    """The companions in ``files`` (the good ones) that weights of the other, not given, shards
    of their shard sets take: those leave the files too, so a shard's tensors are analyzed the
    same whichever shards of its checkpoint are given with it (what makes the results of one
    shard list per machine merge into the result of one run, :mod:`fp8sim.analysis.merge`).
    Those weights are linked on their own copies (nothing read but headers and NVFP4's
    per-tensor scales); a weight that cannot be linked there takes nothing: it is not analyzed
    here, and the run that analyzes it reports it."""
    given = {id(d) for d in files if id(d) not in bad}
    out, linked = [], set()
    for d in files:
        if id(d) not in given or d.kind == "memory":
            continue
        for other in finder.set_shards(d.path):
            if id(other) in linked or id(other) in given or any(other is f for f in files):
                continue
            linked.add(id(other))
            try:
                _, took = _link_dump(other, "apply", block, finder, configs, census=False)
            except ValueError:
                continue
            out += [(owner, comp) for owner, comp in took if id(owner) in given]
    return out


def _link_dump(dump: Dump, mode: str, block, finder: CompanionFinder, configs: dict,
               census: bool = True):
    """:func:`link_fp8_scales` for one file: (notes, [(owner, companion taken)])."""
    notes, taken = [], []

    def note(src: TensorSource, text: str) -> None:
        notes.append({"file": dump.path, "name": src.name, "note": text})

    for k, src in enumerate(dump.tensors):
        if src.dtype == "uint8":
            found = _link_packed(dump, k, src, mode, finder, note, census)
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

        kind, blk, what = _fp8_grouping(src, comp, blocks_of)
        grid = _grid_of(src.shape, kind, blk, comp)
        where = "" if owner is dump else f" (in {owner.path})"
        what += _census_text(grid, census, "scales", "it holds ")
        dump.tensors[k] = ScaledSource(
            src.name, src.file, src.shape, src.dtype, src.read_raw, base=src, grid=grid, kind=kind,
            block=blk, scale_name=comp.name, described=f"{comp.name}{where}: {what}",
        )  # fmt: skip
        taken.append((owner, comp))
        note(src, f"dequantized with {comp.name}{where}: {what}")
    return notes, taken


def _fp8_grouping(src: TensorSource, comp: TensorSource, blocks_of: Callable[[], Any]):
    """(kind, block, description) of an FP8 tensor's companion ``comp``; ValueError naming both
    (with the file) where it fits no grouping. A uint8 companion is MX E8M0 exponents, one per
    32 elements along the last axis (MXFP8); so is an E8M0 one of that shape."""
    w_shape, s_shape = tuple(src.shape), tuple(comp.shape)
    if comp.dtype in E8M0_DTYPES:
        why = mx_grid_shape(w_shape, s_shape)
        if why is None:
            return "block", (1, MX_BLOCK), "MXFP8: 1x32 E8M0 block scales"
        if comp.dtype == "uint8":
            raise ValueError(f"{comp.file}: {comp.name} (uint8: E8M0 exponents) shape "
                             f"{list(s_shape)} does not fit {src.name} shape {list(w_shape)}: "
                             f"{why}")  # fmt: skip
    elif comp.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{comp.file}: {comp.name} (companion of {src.name}) has dtype "
                         f"{comp.dtype}; a scale must be a float, FP8 or E8M0 tensor")  # fmt: skip
    kind, *rest = _scale_kind(w_shape, s_shape, blocks_of)
    if kind is None:
        raise ValueError(f"{comp.file}: {comp.name} shape {list(s_shape)} does not fit "
                         f"{src.name} shape {list(w_shape)}: {rest[0]}")  # fmt: skip
    blk, origin = rest
    what = {"tensor": "one scale for the tensor", "row": "one scale per row",
            "block": f"{blk[0]}x{blk[1]} block scales ({origin})"}[kind]  # fmt: skip
    if kind == "row" and len(s_shape) < len(w_shape) and w_shape[-1] == w_shape[-2]:
        what += ", a 1-D scale on a square weight read as per row"
    return kind, blk, what


def _grid_of(shape: tuple[int, ...], kind: str, blk: tuple[int, int], comp: TensorSource):
    """The companion's :class:`~.scale_grids.ScaleGrid` for a weight of ``shape``: one entry
    (tensor), one per row over the leading dims (row), or (lead x ceil(M / R), ceil(N / C))
    (block)."""
    decode = "e8m0" if comp.dtype in E8M0_DTYPES else "float"
    if kind == "tensor":
        return companion_grid(comp, 1, 1, decode)
    *lead, m, n = shape
    rows = math.prod(lead) * (m if kind == "row" else -(-m // blk[0]))
    return companion_grid(comp, rows, 1 if kind == "row" else -(-n // blk[1]), decode)


def _census_text(grid: ScaleGrid, count: bool, what: str, holds: str = "") -> str:
    """The note's account of a grid's unusual factors ("" when there are none, or ``count`` is
    False); E8M0 NaN codes (0xFF) apart, with how the libraries differ on them."""
    census = grid.census() if count else GridCensus()
    text = ""
    if census.e8m0_nan:
        text += (f"; {census.e8m0_nan} E8M0 NaN {what} (code 0xFF: NaN by the OCP MX spec, its "
                 "block NaN; compressed-tensors, ModelOpt and transformers read it as 2^128)")  # fmt: skip
    others = census.non_finite - census.e8m0_nan
    if others or census.non_positive:
        text += f"; {holds}{others} NaN/inf and {census.non_positive} zero or negative {what}"
    return text


def _link_packed(dump: Dump, k: int, src: TensorSource, mode: str, finder: CompanionFinder,
                 note: Callable[[TensorSource, str], None], census: bool) -> list | None:  # fmt: skip
    """A uint8 tensor that may be a packed MX (:mod:`.mx_scales`) or NVFP4 (:mod:`.fp4_scales`)
    weight: under ``apply`` replaced in ``dump`` by a :class:`ScaledSource` of its dequantized
    values; returns the companions taken ([(owner, source)]) or None."""
    try:
        mx = mx_packed(src, dump, finder)
        found = None if mx is not None else nvfp4_companions(src, dump, finder)
    except ValueError as exc:
        if mode == "stored":
            note(src, f"uint8 tensor skipped; it {exc}")
            return None
        raise ValueError(f"{src.file}: {src.name} {exc}") from None
    if mx is not None:
        return _link_mx(dump, k, src, mode, mx, note, census)
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
        shape, grid = nvfp4_grid(src, found)
    except ValueError as exc:
        raise ValueError(f"{src.file}: {src.name} {exc}") from None
    rule = "scale / global_scale" if found.library == "compressed-tensors" else "scale * scale_2"
    what = f"NVFP4 ({found.library}): E2M1 codes x float32({rule}), 1x16 E4M3 block scales"
    where = {o.path for o in (found.block_owner, found.tensor_owner) if o is not dump}
    if where:
        what += f" (in {', '.join(sorted(where))})"
    what += _census_text(grid, census, "block factors")
    codes = PackedE2M1(src.name, src.file, shape, E2M1_DTYPE, None, base=src)
    dump.tensors[k] = ScaledSource(
        src.name, src.file, shape, E2M1_DTYPE, None, base=codes, grid=grid, kind="block",
        block=(1, NVFP4_BLOCK), scale_name=found.block.name,
        described=f"{found.names}: {what}",
    )  # fmt: skip
    note(src, f"dequantized with {found.names}: {what}")
    return [(found.block_owner, found.block), (found.tensor_owner, found.tensor)]


def _link_mx(dump: Dump, k: int, src: TensorSource, mode: str, mx: MXWeight,
             note: Callable[[TensorSource, str], None], census: bool) -> list | None:  # fmt: skip
    """A packed MX weight (:func:`~.mx_scales.mx_packed`): noted under ``stored``, replaced by
    its dequantized values under ``apply``."""
    fmt = "MXFP6" if mx.element == "E2M3" else "MXFP4"
    layout = mx.layout if mx.layout.endswith(fmt) else f"{mx.layout} {fmt}"
    if mode == "stored":
        note(src, f"packed {fmt} weight ({layout}) skipped as uint8; --scales apply dequantizes "
                  f"it with {mx.scale.name}")  # fmt: skip
        return None
    shape = tuple(mx.codes.shape)
    grid = companion_grid(mx.scale, math.prod(shape[:-1]), shape[-1] // MX_BLOCK, "e8m0")
    what = f"{fmt} ({layout}): {mx.element} codes x E8M0 2^(e-127), 1x32 block scales"
    where = "" if mx.owner is dump else f" (in {mx.owner.path})"
    what += where + _census_text(grid, census, "block scales")
    dump.tensors[k] = ScaledSource(
        src.name, src.file, shape, mx.codes.dtype, None, base=mx.codes, grid=grid, kind="block",
        block=(1, MX_BLOCK), scale_name=mx.scale.name, described=f"{mx.scale.name}: {what}",
    )  # fmt: skip
    note(src, f"dequantized with {mx.scale.name}: {what}")
    return [(mx.owner, mx.scale)]

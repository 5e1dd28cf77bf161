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
  (strategy ``group``: 1 x G) -- else 128 x 128.

Refused, in one line naming both tensors (the weight's file counts as bad, exit 2): a shape that
fits none of these, a companion that is not a float tensor (float16/bfloat16/float32/float64,
an FP8 format or E8M0), both spellings at once, a companion found in several files, a config.json
that declares several block shapes (``--fp8-block`` chooses). Companion entries a dump could not
read as tensors are named with their reason.

Values: ``decode(code) * scale`` computed as torch's ``q.float() * s`` computes it: in float32,
rounded to nearest even, for float32/bfloat16/float16/FP8/E8M0 scales; in float64 for float64
scales. Scales that are NaN, inf, zero or negative are applied as they are, and the note counts
them.

With ``--fp8-scales stored`` (the default) nothing is applied or refused: the FP8 codes are
analyzed as the values they encode, and each FP8 tensor that has a companion gets a note.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from analysis.dumps import FLOAT_DTYPES, FP8_DTYPES, Dump, TensorSource, open_dump

__all__ = ["SCALE_SUFFIXES", "DEFAULT_BLOCK", "parse_block", "link_fp8_scales", "ScaledSource"]

#: companion-name suffixes (both are multipliers)
SCALE_SUFFIXES = ("_scale_inv", "_scale")
#: block shape when neither --fp8-block nor a config.json gives one
DEFAULT_BLOCK = (128, 128)
_MAX_BLOCK = 1 << 31
_SHARD = re.compile(r"^(?P<prefix>.+)-(?P<k>\d+)-of-(?P<total>\d+)\.(?P<ext>safetensors|bin)$")
_E8M0 = "float8_e8m0fnu"
_MAX_CONFIG = 64 << 20  # bytes of a config.json read (a model config is a few KiB)


def parse_block(spec: str, where: str = "--fp8-block") -> tuple[int, int]:
    """``"RxC"`` -> (R, C), both in [1, 2**31]. Raises ValueError naming ``where``."""
    parts = spec.lower().split("x")
    try:
        r, c = (int(p) for p in parts) if len(parts) == 2 else (0, 0)
    except ValueError:
        r, c = 0, 0
    if not (1 <= r <= _MAX_BLOCK and 1 <= c <= _MAX_BLOCK):
        raise ValueError(f"{where} {spec!r}: expected RxC with 1 <= R, C <= 2**31 (e.g. 128x128)")
    return r, c


def _positive_ints(v: Any, n: int) -> bool:
    return (isinstance(v, list) and len(v) == n and all(
        isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= _MAX_BLOCK for x in v))  # fmt: skip


def config_blocks(directory: str) -> tuple[list[tuple[int, int]], str]:
    """(block shapes that ``directory/config.json`` declares, a remark). No config.json, or one
    without a quantization config: ([], ""); one that cannot be read or parsed: ([], why). A
    declaration that is present but malformed raises ValueError naming the file."""
    path = os.path.join(directory, "config.json")
    try:
        with open(path, "rb") as f:
            text = f.read(_MAX_CONFIG + 1)
        if len(text) > _MAX_CONFIG:
            return [], f"config.json not read (over {_MAX_CONFIG >> 20} MiB)"
        cfg = json.loads(text)
    except FileNotFoundError:
        return [], ""
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        return [], f"config.json unreadable: {str(exc).splitlines()[0] if str(exc) else exc}"
    q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if not isinstance(q, dict):
        return [], ""
    found: list[tuple[int, int]] = []
    if "weight_block_size" in q:
        if not _positive_ints(q["weight_block_size"], 2):
            raise ValueError(f"{path}: quantization_config.weight_block_size "
                             f"{q['weight_block_size']!r} is not two positive ints "
                             "(give --fp8-block RxC)")  # fmt: skip
        found.append(tuple(q["weight_block_size"]))
    groups = q.get("config_groups")
    for gname, g in groups.items() if isinstance(groups, dict) else ():
        w = g.get("weights") if isinstance(g, dict) else None
        strategy = w.get("strategy") if isinstance(w, dict) else None
        if strategy == "block":
            if not _positive_ints(w.get("block_structure"), 2):
                raise ValueError(f"{path}: config_groups.{gname}.weights.block_structure "
                                 f"{w.get('block_structure')!r} is not two positive ints")  # fmt: skip
            found.append(tuple(w["block_structure"]))
        elif strategy == "group":
            if not _positive_ints([w.get("group_size")], 1):
                raise ValueError(f"{path}: config_groups.{gname}.weights.group_size "
                                 f"{w.get('group_size')!r} is not a positive int")  # fmt: skip
            found.append((1, w["group_size"]))
    return sorted(set(found)), ""


@dataclass
class ScaledSource(TensorSource):
    """An FP8 tensor read as its dequantized values (see the module docstring). ``scale`` holds
    the companion's values (float32, or float64 for a float64 companion), as a
    (groups along the leading dims and rows, column groups) grid; ``kind`` is ``tensor``,
    ``row`` or ``block``, ``block`` the R x C of the groups (rows: 1 x N), ``described`` a line
    for reports."""

    base: TensorSource = field(repr=False, default=None)
    scale: np.ndarray = field(repr=False, default=None)
    kind: str = "tensor"
    block: tuple[int, int] = (1, 1)
    scale_name: str = ""
    described: str = ""

    def read(self, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` of the flat C-order tensor, dequantized."""
        codes = self.base.read(start, stop)
        if codes.size == 0:
            return codes.astype(self.scale.dtype)
        if self.kind == "tensor":
            return codes * self.scale.reshape(-1)[0]
        return codes * self._scales(max(0, int(start)), codes.size)

    def _scales(self, start: int, size: int) -> np.ndarray:
        """The scale of each element ``start .. start + size - 1``: the chunk is a run of row
        pieces, each a run of column groups, so the per-element scales are ``np.repeat`` of one
        value per (row, column group) piece (no per-element index arithmetic)."""
        m, n = (self.shape[-2], self.shape[-1]) if len(self.shape) >= 2 else (1, self.shape[-1])
        r, c = self.block
        r0, r1 = start // n, (start + size - 1) // n  # rows over the leading dims: lead * m + i
        rows = np.arange(r0, r1 + 1, dtype=np.int64)
        lead, i = np.divmod(rows, m)
        grid_rows = lead * (-(-m // r)) + i // r
        g_lo = np.arange(0, n, c, dtype=np.int64)  # each column group's first and end column
        g_hi = np.minimum(g_lo + c, n)
        lo = np.zeros(rows.size, np.int64)
        hi = np.full(rows.size, n, np.int64)
        lo[0] = start - r0 * n
        hi[-1] = start + size - r1 * n
        counts = np.clip(np.minimum(g_hi, hi[:, None]) - np.maximum(g_lo, lo[:, None]), 0, None)
        return np.repeat(self.scale[grid_rows].reshape(-1), counts.reshape(-1))


def _scale_kind(w_shape: tuple[int, ...], s_shape: tuple[int, ...], block_of: Callable[[], Any]):
    """(kind, block, origin) of a scale of shape ``s_shape`` on a weight of ``w_shape``, or
    (None, why) when it fits no grouping; ``block_of()`` gives (block, origin) and is asked
    only for block scales."""
    if math.prod(s_shape) == 1:
        return "tensor", (1, 1), ""
    if len(w_shape) < 2:
        return None, "a 1-D weight takes one scale (one element)"
    lead, (m, n) = w_shape[:-2], w_shape[-2:]
    if s_shape in (lead + (m,), lead + (m, 1)):
        return "row", (1, n), ""
    (r, c), origin = block_of()
    if s_shape == lead + (-(-m // r), -(-n // c)):
        return "block", (r, c), origin
    hint = origin if origin == "--fp8-block" else f"{origin}; --fp8-block RxC sets it"
    return None, (f"expected one element, one per row {list(lead + (m,))}, or {r}x{c} blocks "
                  f"{list(lead + (-(-m // r), -(-n // c)))} ({hint})")  # fmt: skip


def _scale_values(comp: TensorSource) -> np.ndarray:
    """The companion's values, float32 (float64 for a float64 companion), in its shape."""
    if comp.dtype == _E8M0:
        from fp8sim.emulator import decode_table

        codes = np.asarray(comp._read_raw(0, comp.numel)).view(np.uint8)
        return decode_table("e8m0", np.float32)[codes].reshape(comp.shape)
    v = comp.read_all()
    return v if v.dtype == np.float64 else v.astype(np.float32)


class _Finder:
    """Companions of FP8 tensors: in the weight's file, then in its shard set (see the module
    docstring). Files are keyed by real path (a file given twice is one file)."""

    def __init__(self, files: list[Dump]):
        self.opened: dict[str, Dump | None] = {}
        for d in files:
            self.opened.setdefault(os.path.realpath(d.path), d)

    def _dump(self, path: str) -> Dump | None:
        key = os.path.realpath(path)
        if key not in self.opened:
            try:
                self.opened[key] = open_dump(path)
            except ValueError:
                self.opened[key] = None  # a bad sibling shard: it says so when given itself
        return self.opened[key]

    def _shard_files(self, path: str, names: list[str]) -> list[str]:
        """Other files of ``path``'s shard set that may hold one of ``names``."""
        d, base = os.path.split(os.path.realpath(path))
        m = _SHARD.match(base)
        if m is None:
            return []
        index = os.path.join(d, f"{m['prefix']}.{m['ext']}.index.json")
        try:
            with open(index, "rb") as f:
                wmap = json.loads(f.read()).get("weight_map")
            if isinstance(wmap, dict):
                named = {wmap[n] for n in names if isinstance(wmap.get(n), str)}
                # a bare file name of this directory (the index is untrusted: no paths)
                return [os.path.join(d, f) for f in sorted(named) if os.path.basename(f) == f != base]
        except (OSError, ValueError, UnicodeDecodeError, AttributeError):
            pass
        out = []
        for f in sorted(os.listdir(d)):
            s = _SHARD.match(f)
            same_set = s and (s["prefix"], s["total"], s["ext"]) == (m["prefix"], m["total"], m["ext"])
            if same_set and f != base:
                out.append(os.path.join(d, f))
        return out

    def find(self, src: TensorSource, dump: Dump):
        """(owner dump, companion source, or (name, reason) of an entry its dump skipped), or
        None. Raises ValueError for both spellings or a companion in several files."""
        names = [src.name + sfx for sfx in SCALE_SUFFIXES]
        for pool in ([dump], None):
            if pool is None:
                pool = [x for x in map(self._dump, self._shard_files(dump.path, names)) if x]
            hits = []
            for d in pool:
                hits += [(d, t) for t in d.tensors if t.name in names]
                hits += [(d, s) for s in d.skipped if s[0] in names]
            spelled = {h[1].name if isinstance(h[1], TensorSource) else h[1][0] for h in hits}
            if len(spelled) > 1:
                raise ValueError(f"{src.file}: {src.name} has both {names[0]} and {names[1]}: "
                                 "which one dequantizes it is ambiguous")  # fmt: skip
            if len(hits) > 1:
                raise ValueError(f"{src.file}: {src.name}: its companion {spelled.pop()} is in "
                                 f"several files ({', '.join(d.path for d, _ in hits)})")  # fmt: skip
            if hits:
                return hits[0]
        return None


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
        raise ValueError(f"--fp8-scales {mode!r}: valid: stored, apply")
    files = [d for d in dumps if d.trace is None]
    finder = _Finder(files)
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
    gone = {id(comp) for _, comp in taken}
    for owner in {id(o): o for o, _ in taken}.values():
        owner.tensors = [t for t in owner.tensors if id(t) not in gone]
    dumps[:] = [d for d in dumps if id(d) not in bad]
    return notes


def _link_dump(dump: Dump, mode: str, block, finder: _Finder, configs: dict):
    """:func:`link_fp8_scales` for one file: (notes, [(owner, companion taken)])."""
    notes, taken = [], []

    def note(src: TensorSource, text: str) -> None:
        notes.append({"file": dump.path, "name": src.name, "note": text})

    for k, src in enumerate(dump.tensors):
        if src.dtype not in FP8_DTYPES:
            continue
        if mode == "stored":
            try:
                found = finder.find(src, dump)
            except ValueError as exc:
                msg = str(exc)
                note(src, "FP8 codes analyzed as stored; " + msg.removeprefix(f"{src.file}: "))
                continue
            if found is not None:
                cname = found[1].name if isinstance(found[1], TensorSource) else found[1][0]
                note(src, f"FP8 codes analyzed as stored; its companion {cname} was not applied "
                          "(--fp8-scales apply analyzes the dequantized values)")  # fmt: skip
            continue
        found = finder.find(src, dump)
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

        def block_of():
            if block is not None:
                return block, "--fp8-block"
            d = os.path.dirname(os.path.abspath(dump.path))
            if d not in configs:
                configs[d] = config_blocks(d)
            found_blocks, remark = configs[d]
            if len(found_blocks) > 1:
                shapes = ", ".join(f"{r}x{c}" for r, c in found_blocks)
                raise ValueError(f"{os.path.join(d, 'config.json')} declares block shapes "
                                 f"{shapes}: give --fp8-block RxC")  # fmt: skip
            if found_blocks:
                return found_blocks[0], "config.json"
            return DEFAULT_BLOCK, "default" + (f"; {remark}" if remark else "")

        kind, *rest = _scale_kind(tuple(src.shape), tuple(comp.shape), block_of)
        if kind is None:
            raise ValueError(f"{comp.file}: {comp.name} shape {list(comp.shape)} does not fit "
                             f"{src.name} shape {list(src.shape)}: {rest[0]}")  # fmt: skip
        blk, origin = rest
        values = _scale_values(comp)
        what = {"tensor": "one scale for the tensor", "row": "one scale per row",
                "block": f"{blk[0]}x{blk[1]} block scales ({origin})"}[kind]  # fmt: skip
        if kind == "row" and len(comp.shape) == len(src.shape) - 1 and src.shape[-1] == src.shape[-2]:
            what += ", a 1-D scale on a square weight read as per row"
        where = "" if owner is dump else f" (in {owner.path})"
        n_bad = int((~np.isfinite(values)).sum())
        n_nonpos = int((values <= 0).sum())
        if n_bad or n_nonpos:
            what += f"; it holds {n_bad} NaN/inf and {n_nonpos} zero or negative scales"
        grid = values.reshape(-1, values.shape[-1] if kind == "block" else 1)  # (grid rows, column groups)
        dump.tensors[k] = ScaledSource(
            src.name, src.file, src.shape, src.dtype, src._read_raw, base=src, scale=grid, kind=kind,
            block=blk, scale_name=comp.name, described=f"{comp.name}{where}: {what}",
        )  # fmt: skip
        taken.append((owner, comp))
        note(src, f"dequantized with {comp.name}{where}: {what}")
    return notes, taken

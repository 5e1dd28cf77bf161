"""Where an FP8 tensor's companion scale is, and which block shape a checkpoint declares: the
lookups behind :mod:`analysis.dumps.fp8_scales` (see its docstring for the rules).

Every file read here (an index, a config.json) is untrusted: read whole up to
:data:`MAX_JSON_BYTES`, parsed with ``json``, and a file that cannot be read or parsed (too
large, not UTF-8, too deeply nested) is treated as absent or malformed, never followed blindly.
"""

from __future__ import annotations

import json
import os
import re
import stat
from typing import Any

from fp8sim.input_files import open_regular
from fp8sim.analysis.dumps.core import Dump, TensorSource, open_dump

__all__ = ["SCALE_SUFFIXES", "MAX_JSON_BYTES", "CompanionFinder", "config_blocks", "parse_block"]

#: companion-name suffixes (both are multipliers)
SCALE_SUFFIXES = ("_scale_inv", "_scale")
#: bytes of an index or config.json read (a model's config is KiBs, an index MiBs)
MAX_JSON_BYTES = 64 << 20
_SHARD = re.compile(r"^(?P<prefix>.+)-(?P<k>\d+)-of-(?P<total>\d+)\.(?P<ext>safetensors|bin)$")


def read_json(path: str) -> tuple[Any, str]:
    """(parsed JSON, "") or (None, why it could not be read); (None, "") if there is no file.
    Only a regular file is opened (a FIFO would block): anything else is "not a regular file"."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None, "is not a regular file"
        with open_regular(path) as f:  # stat'ed again once open: never a FIFO swapped in
            text = f.read(MAX_JSON_BYTES + 1)
    except FileNotFoundError:
        return None, ""
    except ValueError:
        return None, "is not a regular file"
    except OSError as exc:
        return None, f"cannot read ({exc.strerror or exc})"
    if len(text) > MAX_JSON_BYTES:
        return None, f"over {MAX_JSON_BYTES >> 20} MiB"
    try:
        return json.loads(text), ""
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return None, f"not JSON ({first})"


def parse_block(spec: Any, where: str = "--fp8-block") -> tuple[int, int]:
    """``"RxC"`` -> (R, C), through :func:`fp8sim.scaling.parse_granularity` (``block:RxC``).
    Raises ValueError naming ``where``."""
    from fp8sim.scaling import parse_granularity

    try:
        g = parse_granularity(f"block:{spec.strip()}") if isinstance(spec, str) else None
    except ValueError:
        g = None
    if g is None or g.kind != "block":
        raise ValueError(f"{where} {spec!r}: expected RxC with R, C >= 1 (e.g. 128x128)")
    return g.block


def _block_pair(v: Any) -> tuple[int, int] | None:
    """(R, C) from ``[R, C]`` or ``"RxC"``, both >= 1; None otherwise."""
    ints = isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
    if ints and len(v) == 2:
        v = f"{v[0]}x{v[1]}"
    try:
        return parse_block(v)
    except ValueError:
        return None


def config_blocks(directory: str) -> tuple[list[tuple[int, int]], str]:
    """(block shapes that ``directory/config.json`` declares, a remark): FineGrainedFP8's
    ``quantization_config.weight_block_size``, and compressed-tensors' ``config_groups.*.weights``
    with strategy ``block`` (``block_structure``: [R, C] or "RxC") or ``group`` (``group_size``
    G: 1 x G). No config.json or no quantization config: ([], ""); one that cannot be read or
    parsed: ([], why). A declaration that is present but malformed raises ValueError naming the
    file."""
    path = os.path.join(directory, "config.json")
    cfg, why = read_json(path)
    if why:
        return [], f"config.json {why}"
    q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if not isinstance(q, dict):
        return [], ""
    found: list[tuple[int, int]] = []
    hint = " (give --fp8-block RxC)"
    if "weight_block_size" in q:
        pair = _block_pair(q["weight_block_size"])
        if pair is None:
            raise ValueError(f"{path}: quantization_config.weight_block_size "
                             f"{q['weight_block_size']!r} is not two positive ints{hint}")  # fmt: skip
        found.append(pair)
    groups = q.get("config_groups")
    for gname, g in groups.items() if isinstance(groups, dict) else ():
        w = g.get("weights") if isinstance(g, dict) else None
        strategy = w.get("strategy") if isinstance(w, dict) else None
        if strategy == "block":
            pair = _block_pair(w.get("block_structure"))
            if pair is None:
                raise ValueError(f"{path}: config_groups.{gname}.weights.block_structure "
                                 f"{w.get('block_structure')!r} is not two positive ints{hint}")  # fmt: skip
            found.append(pair)
        elif strategy == "group":
            pair = _block_pair([1, w.get("group_size")])
            if pair is None:
                raise ValueError(f"{path}: config_groups.{gname}.weights.group_size "
                                 f"{w.get('group_size')!r} is not a positive int{hint}")  # fmt: skip
            found.append(pair)
    return sorted(set(found)), ""


class CompanionFinder:
    """Companions of FP8 tensors: in the weight's file, then in its shard set.

    A shard set is the files ``PREFIX-KKKKK-of-NNNNN.EXT`` of one directory (the directory and
    name as given, or, for a symbolic link elsewhere, where it points); the set's index
    ``PREFIX.EXT.index.json`` (its ``weight_map``) says which shard holds a name, else every
    shard of the set is searched. Shards not among the analyzed files are opened for the lookup
    (headers only). Files are told apart by real path: a file given twice is searched once.

    A companion that is expected but cannot be looked at is an error, never "no companion": an
    index entry naming a shard that cannot be read, or that does not hold it (a stale index,
    the weight's own file included); without an index, a shard of the set that cannot be read
    or is missing (1..N by its ``-of-N``) -- the companion may be there. A tensor named like a
    companion (an FP8 scale) is not expected to have one of its own: for it, only the index's
    entries count.
    """

    def __init__(self, files: list[Dump]):
        self._opened: dict[str, Dump | None] = {}
        for d in files:
            self._opened.setdefault(os.path.realpath(d.path), d)
        self._why: dict[str, str] = {}  # real path -> why it could not be opened
        self._names: dict[int, dict[str, list[Any]]] = {}
        self._indexes: dict[str, Any] = {}

    def _dump(self, path: str) -> Dump | None:
        key = os.path.realpath(path)
        if key not in self._opened:
            try:
                self._opened[key] = open_dump(path)
            except ValueError as exc:
                self._opened[key] = None  # a bad shard: it says so when it is given itself
                why = str(exc)
                self._why[key] = why[len(path) + 2:] if why.startswith(f"{path}: ") else why
        return self._opened[key]

    def _entries(self, dump: Dump, name: str) -> list[Any]:
        """The tensors, and the (name, reason) entries the dump skipped, called ``name``."""
        table = self._names.get(id(dump))
        if table is None:
            table = self._names[id(dump)] = {}
            for t in dump.tensors:
                table.setdefault(t.name, []).append(t)
            for s in dump.skipped:
                table.setdefault(s[0], []).append(s)
        return table.get(name, [])

    def _index(self, path: str) -> dict | None:
        """An index's weight_map (a dict of names to bare file names), None if it is absent or
        malformed (then the whole shard set is searched). Read once."""
        if path not in self._indexes:
            doc, _ = read_json(path)
            wmap = doc.get("weight_map") if isinstance(doc, dict) else None
            ok = isinstance(wmap, dict) and all(isinstance(v, str) for v in wmap.values())
            self._indexes[path] = wmap if ok else None
        return self._indexes[path]

    def _shard_files(self, path: str, names: list[str]):
        """(the other files of ``path``'s shard set that may hold one of ``names``, the index,
        {name: file} of the index's entries for ``names``, [the first missing shard's path, how
        many are missing, of how many]): ``([], None, {}, [])`` for a file that is no shard;
        the index is None and its entries {} where there is none, the missing [] where there is
        one."""
        for where in (os.path.abspath(path), os.path.realpath(path)):
            d, base = os.path.split(where)
            m = _SHARD.match(base)
            if m is None:
                continue
            index = os.path.join(d, f"{m['prefix']}.{m['ext']}.index.json")
            wmap = self._index(index)
            if wmap is not None:
                named = {n: wmap[n] for n in names if n in wmap}
                for f in sorted(set(named.values())):
                    if os.path.basename(f) != f or not os.path.isfile(os.path.join(d, f)):
                        raise ValueError(f"has its companion in {f!r} by {index}, which is not a "
                                         "file of that directory")  # fmt: skip
                files = [os.path.join(d, f) for f in sorted(set(named.values())) if f != base]
                return files, index, named, []
            key = (m["prefix"], m["total"], m["ext"])
            siblings = [(f, _SHARD.match(f)) for f in sorted(os.listdir(d)) if f != base]
            same = [(f, s) for f, s in siblings if s and (s["prefix"], s["total"], s["ext"]) == key]
            total = int(m["total"])
            ks = [int(m["k"])] + [int(s["k"]) for _, s in same]
            have = sorted({k for k in ks if 1 <= k <= total})
            missing: list = []
            if len(have) < total:
                first = next((i + 1 for i, k in enumerate(have) if k != i + 1), len(have) + 1)
                shown = f"{m['prefix']}-{first:0{len(m['k'])}d}-of-{m['total']}.{m['ext']}"
                missing = [os.path.join(d, shown), total - len(have), total]
            return [os.path.join(d, f) for f, _ in same], None, {}, missing
        return [], None, {}, []

    def set_shards(self, path: str) -> list[Dump]:
        """The other shards of ``path``'s shard set that can be opened (headers only; the
        index's files, else the set's files in its directory), as dumps: ``[]`` for a file that
        is no shard. Shards that cannot be read are left out (their weights are not looked at)."""
        for where in (os.path.abspath(path), os.path.realpath(path)):
            d, base = os.path.split(where)
            m = _SHARD.match(base)
            if m is None:
                continue
            wmap = self._index(os.path.join(d, f"{m['prefix']}.{m['ext']}.index.json"))
            if wmap is not None:
                names = sorted({f for f in wmap.values() if os.path.basename(f) == f})
            else:
                key = (m["prefix"], m["total"], m["ext"])
                names = [f for f in sorted(os.listdir(d)) if (s := _SHARD.match(f))
                         and (s["prefix"], s["total"], s["ext"]) == key]  # fmt: skip
            here = os.path.realpath(path)
            out = []
            for f in names:
                p = os.path.join(d, f)
                if os.path.realpath(p) != here and os.path.isfile(p):
                    dump = self._dump(p)
                    if dump is not None:
                        out.append(dump)
            return out
        return []

    def find(self, src: TensorSource, dump: Dump, names: list[str] | None = None):
        """(owner dump, companion source or the (name, reason) its dump skipped it with), or
        None. ``names``: the companion's possible names (default: the FP8 spellings
        ``NAME_scale_inv``, ``NAME_scale``). Raises ValueError ``"<what is wrong>"`` (no file or
        tensor prefix: the caller says whose) for two spellings at once, or a companion in
        several files, and for one that is expected but cannot be looked at (see the class
        docstring)."""
        if names is None:
            names = [src.name + sfx for sfx in SCALE_SUFFIXES]
        own = [(dump, e) for n in names for e in self._entries(dump, n)]
        if own:
            return self._one(own, names)
        here = os.path.realpath(dump.path)
        files, index, named, missing = self._shard_files(dump.path, names)
        pool, seen, unreadable = [], set(), []
        for p in files:
            d = self._dump(p)
            if d is None:
                unreadable.append(p)
            elif id(d) not in seen and os.path.realpath(d.path) != here:
                seen.add(id(d))
                pool.append(d)
        hits = [(d, e) for d in pool for n in names for e in self._entries(d, n)]
        if hits:
            return self._one(hits, names)
        at = {n: os.path.join(os.path.dirname(index), f) for n, f in named.items()} if index else {}
        for n in sorted(at, key=lambda n: (at[n] not in unreadable, n)):  # the index says where
            p, f = at[n], named[n]
            if p in unreadable:
                why = self._why.get(os.path.realpath(p), "not a dump")
                raise ValueError(f"has its companion {n} in {p} by {index}, which cannot be read "
                                 f"({why})")  # fmt: skip
            raise ValueError(f"has its companion {n} in {f!r} by {index}, which does not hold it "
                             "(a stale index entry)")  # fmt: skip
        if src.name.endswith(SCALE_SUFFIXES):  # a scale itself: not expected to have one
            return None
        if unreadable:
            p = unreadable[0]
            why = self._why.get(os.path.realpath(p), "not a dump")
            raise ValueError(f"may have its companion in {p}, a shard of its set that cannot be "
                             f"read ({why})")  # fmt: skip
        if missing:
            shown, count, total = missing
            more = f" ({count} of {total} shards missing)" if count > 1 else ""
            raise ValueError(f"may have its companion in {shown}, a shard of its set that is not "
                             f"there{more}")  # fmt: skip
        return None

    @staticmethod
    def _one(hits: list, names: list[str]):
        spelled = {e.name if isinstance(e, TensorSource) else e[0] for _, e in hits}
        if len(spelled) > 1:
            raise ValueError(f"has both {names[0]} and {names[1]}: which one dequantizes it is "
                             "ambiguous")  # fmt: skip
        if len(hits) > 1:
            raise ValueError(f"has its companion {spelled.pop()} in several places "
                             f"({', '.join(d.path for d, _ in hits)})")  # fmt: skip
        return hits[0]

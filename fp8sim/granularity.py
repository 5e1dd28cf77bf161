"""Granularity: how a tensor's 2-D view is tiled into groups that share one scale.

A light module (numpy only): recipes hold :class:`Granularity` objects, and the spellings
(``"block:1x128"``, ``"mx:rceil"``, ``"nvfp4:2d"``) are parsed into them once, at the edges, by
:func:`parse_granularity`. The tables of shapes and the scale rules: :mod:`fp8sim.scaling`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import Enum

import numpy as np

__all__ = ["GRANULARITY_KINDS", "MX_BLOCK", "MX_RULES", "E8M0Rule", "Granularity", "parse_granularity",
           "view2d", "NVFP4_LAYOUTS", "NVFP4_VARIANTS", "check_layout", "check_variant"]

NVFP4_LAYOUTS = {"1x16": (1, 16), "16x1": (16, 1), "16x16": (16, 16)}
NVFP4_VARIANTS = ("te", "torchao", "torchao-block", "compressed-tensors")
_VARIANT_ALIASES = {"ct": "compressed-tensors", "transformer-engine": "te"}


def check_variant(variant: str) -> str:
    """The canonical NVFP4 variant name (one of :data:`NVFP4_VARIANTS`; ``ct`` is an alias)."""
    key = str(variant).strip().lower()
    key = _VARIANT_ALIASES.get(key, key)
    if key not in NVFP4_VARIANTS:
        raise ValueError(f"unknown NVFP4 variant {variant!r}; valid: {', '.join(NVFP4_VARIANTS)}")
    return key


def check_layout(layout: str | tuple[int, int]) -> tuple[int, int]:
    """``"1x16"``, ``"16x1"``, ``"16x16"`` (or the tuple) as the NVFP4 block ``(R, C)``."""
    if isinstance(layout, tuple) and layout in NVFP4_LAYOUTS.values():
        return layout
    key = str(layout).strip().lower()
    if key not in NVFP4_LAYOUTS:
        raise ValueError(f"unknown NVFP4 block layout {layout!r}; valid: {', '.join(NVFP4_LAYOUTS)}")
    return NVFP4_LAYOUTS[key]


GRANULARITY_KINDS = ("tensor", "row", "col", "block", "mx", "nvfp4")
MX_BLOCK = 32


class E8M0Rule(str, Enum):
    """How an MX block's E8M0 scale is rounded (see :func:`mx_shared_scale`)."""

    FLOOR = "floor"  #: OCP MX v1.0 section 6.3: ``floor(log2(amax)) - emax_elem``
    RCEIL = "rceil"  #: cuBLAS, Transformer Engine, cuDNN: the float32 descale rounded up

    def __str__(self) -> str:
        return self.value


MX_RULES = tuple(r.value for r in E8M0Rule)
_BLOCK_RE = re.compile(r"^block:(-?\d+)x(-?\d+)$")


# -- granularity -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Granularity:
    """How a tensor's 2-D view is tiled into groups that share one scale.

    Build one with the constructors (``Granularity.tensor()``, ``.row()``, ``.col()``,
    ``.blocks(1, 128)``, ``.mx("rceil")``, ``.nvfp4("16x16", "te")``) or parse a spelling once,
    at an edge, with :func:`parse_granularity`.

    Attributes:
        kind: one of :data:`GRANULARITY_KINDS`.
        block: ``(R, C)`` tile for ``block``; ``(1, 32)`` for ``mx``; None otherwise.
        mx_rule: the :class:`E8M0Rule` for ``mx``; None otherwise.
        variant: the NVFP4 variant (:data:`fp8sim.nvfp4.NVFP4_VARIANTS`) for ``nvfp4``; else None.
    """

    kind: str
    block: tuple[int, int] | None = None
    mx_rule: E8M0Rule | None = None
    variant: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in GRANULARITY_KINDS:
            raise ValueError(f"Granularity.kind must be one of {', '.join(GRANULARITY_KINDS)}, got {self.kind!r}")
        if self.mx_rule is not None and not isinstance(self.mx_rule, E8M0Rule):
            object.__setattr__(self, "mx_rule", E8M0Rule(self.mx_rule))

    @classmethod
    def tensor(cls) -> "Granularity":
        """One scale for the whole tensor."""
        return cls("tensor")

    @classmethod
    def row(cls) -> "Granularity":
        """One scale per row of the 2-D view (along the last axis)."""
        return cls("row")

    @classmethod
    def col(cls) -> "Granularity":
        """One scale per column of the 2-D view."""
        return cls("col")

    @classmethod
    def blocks(cls, rows: int, cols: int) -> "Granularity":
        """One float32 scale per ``rows x cols`` tile (``blocks(1, 128)``, ``blocks(128, 128)``)."""
        for v in (rows, cols):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= v <= _MAX_BLOCK:
                raise ValueError(f"Granularity.blocks: block sizes must be integers in [1, 2**62], got {rows}x{cols}")
        return cls("block", (int(rows), int(cols)))

    @classmethod
    def mx(cls, rule: E8M0Rule | str = E8M0Rule.FLOOR) -> "Granularity":
        """OCP MX: one E8M0 scale per 32 elements along the last axis, rounded by ``rule``."""
        try:
            return cls("mx", (1, MX_BLOCK), E8M0Rule(rule))
        except ValueError:
            raise ValueError(f"unknown MX scale rule {rule!r}; valid: {', '.join(MX_RULES)}") from None

    @classmethod
    def nvfp4(cls, layout: str = "1x16", variant: str = "te") -> "Granularity":
        """NVFP4's two levels: an E4M3 scale per 16 elements (``layout`` 1x16, 16x1, 16x16 or
        2d) and a float32 tensor scale, by the rules of ``variant`` (:mod:`fp8sim.nvfp4`)."""
        return cls("nvfp4", check_layout("16x16" if layout == "2d" else layout), variant=check_variant(variant))

    @property
    def spec(self) -> str:
        """Canonical spelling: ``parse_granularity(g.spec) == g``."""
        if self.kind == "block":
            return f"block:{self.block[0]}x{self.block[1]}"
        if self.kind == "mx":
            return "mx" if self.mx_rule == E8M0Rule.FLOOR else f"mx:{self.mx_rule.value}"
        if self.kind == "nvfp4":
            lay = {(1, 16): "", (16, 1): ":16x1", (16, 16): ":2d"}[self.block]
            return f"nvfp4{lay}" + ("" if self.variant == "te" else f":{self.variant}")
        return self.kind

    def __str__(self) -> str:
        return self.spec

    def tile(self, m: int, n: int) -> tuple[int, int]:
        """The tile ``(R, C)`` on a 2-D view of shape ``(m, n)`` (at least 1 x 1)."""
        if self.kind == "tensor":
            return max(m, 1), max(n, 1)
        if self.kind == "row":
            return 1, max(n, 1)
        if self.kind == "col":
            return max(m, 1), 1
        return self.block

    def grid(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the amax / scale array for a tensor of ``shape`` (see the module table)."""
        if self.kind == "tensor":
            return ()
        return self.grid2d(*view2d(shape))

    def grid2d(self, m: int, n: int) -> tuple[int, int]:
        """Groups along each axis of the 2-D view ``(m, n)`` (``(1, 1)`` for tensor)."""
        if self.kind == "tensor":
            return 1, 1
        r, c = self.tile(m, n)
        return -(-m // r), -(-n // c)


_MAX_BLOCK = 1 << 62  # block sides fit int64 (a block larger than the tensor is one block)


def parse_granularity(spec: str | Granularity) -> Granularity:
    """Parse ``"tensor"``, ``"row"``, ``"col"``, ``"block:RxC"``, ``"mx"``, ``"mx:floor"``,
    ``"mx:rceil"``, ``"nvfp4[:LAYOUT][:VARIANT]"`` (layout 1x16, 16x1, 16x16 or 2d; variant te,
    torchao, torchao-block, compressed-tensors or ct). Raises ValueError naming the valid
    spellings; block sizes must be >= 1."""
    if isinstance(spec, Granularity):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"granularity must be a string, got {type(spec).__name__}")
    key = spec.strip().lower()
    if key in ("tensor", "row", "col"):
        return Granularity(key)
    if key in ("mx", "mx:floor"):
        return Granularity.mx(E8M0Rule.FLOOR)
    if key == "mx:rceil":
        return Granularity.mx(E8M0Rule.RCEIL)
    if key == "nvfp4" or key.startswith("nvfp4:"):
        parts = key.split(":")[1:]
        lay = parts.pop(0) if parts and parts[0] in (*NVFP4_LAYOUTS, "2d") else "1x16"
        if len(parts) > 1:
            raise ValueError(f"granularity {spec!r}: nvfp4[:LAYOUT][:VARIANT] has at most two parts")
        return Granularity.nvfp4(lay, parts[0] if parts else "te")
    match = _BLOCK_RE.match(key)
    if match:
        r, c = int(match.group(1)), int(match.group(2))
        if not (1 <= r <= _MAX_BLOCK and 1 <= c <= _MAX_BLOCK):
            raise ValueError(f"granularity {spec!r}: block sizes must be positive and at most "
                             f"2**62, got {r}x{c}")  # fmt: skip
        return Granularity("block", (r, c))
    raise ValueError(
        f"unknown granularity {spec!r}; valid: tensor, row, col, block:RxC (R, C >= 1, e.g. "
        "block:1x128, block:128x128), mx, mx:floor, mx:rceil, "
        "nvfp4[:1x16|:16x1|:16x16|:2d][:te|:torchao|:torchao-block|:compressed-tensors]"
    )


def view2d(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(M, N)``: the last axis, and the product of all others (1 for 0-d and 1-D)."""
    if len(shape) == 0:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]

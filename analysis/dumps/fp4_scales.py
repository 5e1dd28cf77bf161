"""Packed NVFP4 checkpoint weights and their two scales (``fp8sim analyze --scales apply``).

An NVFP4 checkpoint stores each quantized weight of logical shape ``(..., M, N)`` as three
tensors: the E2M1 codes packed two per byte (uint8 ``(..., M, N / 2)``; element ``2k`` in the low
nibble, ``2k + 1`` in the high one, as ``torch.float4_e2m1fn_x2``), one E4M3 scale per 16
elements along the last axis (float8_e4m3fn ``(..., M, ceil(N / 16))``, the last block ragged),
and one float32 per-tensor scale. Two spellings are read, as their libraries write them:

* compressed-tensors (``nvfp4-pack-quantized``, e.g. llm-compressor's NVFP4 models):
  ``<p>.weight_packed``, ``<p>.weight_scale``, ``<p>.weight_global_scale``. The global scale
  ``G`` is the reciprocal kind (``2688 / amax``); compressed-tensors dequantizes
  ``code * (float32(scale) / G)``;
* NVIDIA ModelOpt (``quant_algo: NVFP4``): ``<p>.weight``, ``<p>.weight_scale``,
  ``<p>.weight_scale_2`` (``amax / 2688``), plus ``<p>.input_scale`` for the activations (an
  ordinary tensor here); ModelOpt dequantizes ``code * (float32(scale) * scale_2)``.

Values, per element: ``float32(e2m1(code) * f)`` with the block's float32 factor ``f =
float32(b / G)`` or ``float32(b * scale_2)`` (``b`` the decoded E4M3 scale) -- the products both
libraries compute in float32 (:func:`fp8sim.nvfp4.block_decode_scale`, variants
``compressed-tensors`` and ``torchao``, whose decode rule is ModelOpt's). Both then cast the
result to the model's dtype (bfloat16 in compressed-tensors' decompressor); fp8sim analyzes the
float32 values, before that cast. A NaN E4M3 scale (code 0x7F) makes its block NaN. The global
scale is one float32 element, or for stacked weights (experts: ``(E, M, N / 2)``) one per leading
index.

Where the companions are looked for: as for FP8 companions (:mod:`.fp8_companions`: the
weight's file, then its shard set). A uint8 tensor is taken as a packed NVFP4 weight when it has
an E4M3 block-scale companion (``<p>.weight_scale`` next to ``<p>.weight_packed``; ``<name>_scale``
next to ``<name>``); then the per-tensor scale must be there too, a float32 of one element (or
one per leading index), and the block scale's shape must be ``(..., M, ceil(N / 16))`` -- else
the weight's file is refused in one line naming both tensors. A uint8 tensor whose ``_scale`` is
not E4M3 (an MXFP4 checkpoint's E8M0 exponents, an INT4 checkpoint's float16 scales) is not
read: it stays skipped, with a note.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
import numpy as np

from fp8sim.analysis.dumps.core import Dump, TensorSource
from fp8sim.analysis.dumps.fp8_companions import CompanionFinder
from fp8sim.analysis.dumps.scale_grids import NVFP4Grid
from fp8sim.nvfp4 import NVFP4_BLOCK

__all__ = ["E2M1_DTYPE", "PackedCodes", "PackedE2M1", "NVFP4Companions", "nvfp4_companions", "nvfp4_grid"]

#: dtype name of a dequantized NVFP4 weight's elements (the unpacked ``float4_e2m1fn_x2``)
E2M1_DTYPE = "float4_e2m1fn"
_E4M3 = "float8_e4m3fn"
_PACKED = "_packed"


@dataclass
class PackedCodes(TensorSource):
    """The values of narrow-float codes packed into a uint8 tensor (``base``), ``per_group``
    codes in ``group_bytes`` bytes, in flat order; subclasses give the element format
    (:attr:`FORMAT`) and :meth:`unpack`. :meth:`read` gives float32."""

    base: TensorSource = field(repr=False, default=None)
    FORMAT = ""
    PER_GROUP, GROUP_BYTES = 1, 1

    @property
    def is_float(self) -> bool:
        return True

    @classmethod
    def unpack(cls, raw: np.ndarray) -> np.ndarray:
        """uint8 codes of whole groups of bytes ``raw``, in element order."""
        raise NotImplementedError

    def read(self, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` of the flat unpacked tensor, as float32 values."""
        from fp8sim.emulator import decode_table

        start, stop = max(0, int(start)), min(self.numel, int(stop))
        if stop <= start:
            return np.zeros(0, np.float32)
        g0, g1 = start // self.PER_GROUP, -(-stop // self.PER_GROUP)
        try:
            raw = self.base.read_raw(g0 * self.GROUP_BYTES, g1 * self.GROUP_BYTES)
        except ValueError:
            raise
        except Exception as exc:  # OS errors while streaming
            raise ValueError(f"{self.file}: cannot read {self.base.name}: {exc}") from None
        codes = self.unpack(np.asarray(raw).view(np.uint8))
        first = g0 * self.PER_GROUP
        return decode_table(self.FORMAT, np.float32)[codes[start - first : stop - first]]


@dataclass
class PackedE2M1(PackedCodes):
    """E2M1 codes two per byte, low nibble first (``torch.float4_e2m1fn_x2``): logical shape
    ``(..., 2 * K)`` for a packed ``(..., K)``."""

    FORMAT = "e2m1"
    PER_GROUP, GROUP_BYTES = 2, 1

    @classmethod
    def unpack(cls, raw: np.ndarray) -> np.ndarray:
        return np.stack([raw & np.uint8(0xF), raw >> np.uint8(4)], axis=-1).reshape(-1)


@dataclass
class NVFP4Companions:
    """What :func:`nvfp4_companions` found for a packed weight: the library's spelling
    (``compressed-tensors`` or ``modelopt``), the block scale and per-tensor scale sources with
    their owner dumps."""

    library: str
    block: TensorSource
    block_owner: Dump
    tensor: TensorSource
    tensor_owner: Dump

    @property
    def names(self) -> str:
        return f"{self.block.name} and {self.tensor.name}"


def _names(src: TensorSource) -> tuple[str, str, str]:
    """(library, block scale name, per-tensor scale name) of a packed weight's companions."""
    if src.name.endswith(_PACKED):
        base = src.name[: -len(_PACKED)]
        return "compressed-tensors", base + "_scale", base + "_global_scale"
    return "modelopt", src.name + "_scale", src.name + "_scale_2"


def _found(finder: CompanionFinder, src: TensorSource, dump: Dump, name: str):
    found = finder.find(src, dump, [name])
    if found is not None and not isinstance(found[1], TensorSource):
        owner, (cname, why) = found
        raise ValueError(f"{owner.path}: {cname} (companion of {src.name}) cannot be used: {why}")
    return found


def nvfp4_companions(src: TensorSource, dump: Dump, finder: CompanionFinder):
    """For a uint8 tensor: None (no E4M3 block scale: not an NVFP4 weight), a note string (a
    ``_scale`` companion that is not E4M3: not read), or :class:`NVFP4Companions`. Raises
    ValueError ``"<what is wrong>"`` (the caller names the file and tensor) for a missing or
    malformed per-tensor scale, and as :meth:`CompanionFinder.find` does."""
    library, block_name, tensor_name = _names(src)
    found = _found(finder, src, dump, block_name)
    if found is None:
        return None
    block_owner, block = found
    if block.dtype != _E4M3:
        return (f"uint8 tensor not read: its companion {block.name} has dtype {block.dtype}, not "
                f"{_E4M3} (NVFP4) nor E8M0 (MX): only NVFP4 and MX packed weights are "
                "dequantized")  # fmt: skip
    found = _found(finder, src, dump, tensor_name)
    if found is None:
        raise ValueError(f"has the NVFP4 block scale {block.name} but no {tensor_name} (its "
                         f"per-tensor scale in {library} checkpoints)")  # fmt: skip
    tensor_owner, tensor = found
    if tensor.dtype != "float32":
        raise ValueError(f"has the per-tensor scale {tensor.name} of dtype {tensor.dtype}; "
                         f"{library} stores a float32")  # fmt: skip
    return NVFP4Companions(library, block, block_owner, tensor, tensor_owner)


def nvfp4_grid(src: TensorSource, comp: NVFP4Companions) -> tuple[tuple[int, ...], NVFP4Grid]:
    """(logical shape ``(..., M, 2 * K)``, the :class:`~.scale_grids.NVFP4Grid` of its float32
    block factors over (leading dims x M, ceil(N / 16))) of a packed weight ``src`` of shape
    ``(..., M, K)``: ``float32(b / G)`` (compressed-tensors) or ``float32(b * scale_2)``
    (ModelOpt), decoded per chunk. Raises ValueError ``"<what is wrong>"`` for shapes that do
    not fit."""
    if len(src.shape) < 2:
        raise ValueError(f"is a packed NVFP4 weight of shape {list(src.shape)}; at least 2-D "
                         "(rows, packed columns) expected")  # fmt: skip
    *lead, m, k = src.shape
    shape = (*lead, m, 2 * k)
    want = (*lead, m, -(-2 * k // NVFP4_BLOCK))
    if tuple(comp.block.shape) != want:
        raise ValueError(f"{comp.block.name} shape {list(comp.block.shape)} does not fit "
                         f"{src.name} shape {list(src.shape)} (NVFP4 weight {list(shape)}): "
                         f"expected {list(want)}, one E4M3 scale per 16 elements")  # fmt: skip
    n_lead = math.prod(lead)
    t_numel = comp.tensor.numel
    if t_numel != 1 and not (lead and t_numel == n_lead):
        per = f" or {n_lead} (one per leading index {list(lead)})" if lead else ""
        raise ValueError(f"has the per-tensor scale {comp.tensor.name} of shape "
                         f"{list(comp.tensor.shape)}; expected one element{per}")  # fmt: skip
    t = np.asarray(comp.tensor.read_all(), np.float32).reshape(-1)  # one per leading index
    variant = "compressed-tensors" if comp.library == "compressed-tensors" else "torchao"
    grid = NVFP4Grid(n_lead * m, want[-1], np.float32, block=comp.block, tensor_scales=t,
                     per_lead=max(1, m * want[-1]), variant=variant)  # fmt: skip
    return shape, grid

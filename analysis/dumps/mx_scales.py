"""MX checkpoint weights (OCP Microscaling: 32 elements share one E8M0 scale ``2 ** (e - 127)``)
and their scales (``fp8sim analyze --scales apply``).

Layouts read, as the writing libraries store them (blocks along the last axis of a logical
``(..., M, N)`` weight; leading dimensions such as stacked experts are the scale's too):

* compressed-tensors ``mxfp4-pack-quantized`` (preset ``MXFP4A16``; also NVIDIA ModelOpt's MXFP4
  export): ``<p>.weight_packed`` (ModelOpt: ``<p>.weight``) uint8 ``(..., M, N / 2)``, E2M1 codes
  two per byte, element ``2k`` in the low nibble; ``<p>.weight_scale`` uint8 ``(..., M, N / 32)``,
  E8M0 codes;
* compressed-tensors ``mxfp6-pack-quantized`` (``MXFP6A16``): ``<p>.weight_packed`` uint8
  ``(..., M, 3 N / 4)``, E2M3 codes (sign in bit 5) four per three bytes, little-endian (code
  ``j`` of a group in bits ``6 j .. 6 j + 5`` of ``b0 | b1 << 8 | b2 << 16``); the same scale;
* gpt-oss (OpenAI's MoE weights; transformers' ``convert_moe_packed_tensors`` dequantizes them):
  ``<p>_blocks`` uint8 ``(..., R, G, 16)``, 32 E2M1 codes per 16 bytes as above, and
  ``<p>_scales`` uint8 ``(..., R, G)``, E8M0 codes; the weight is ``(..., R, 32 G)`` (transformers
  then transposes its last two axes for its own forward; the analysis keeps the stored
  orientation, blocks along the last axis). OpenAI's original checkpoints spell them
  ``<p>.blocks`` / ``<p>.scales``;
* MXFP8 (compressed-tensors ``mxfp8-quantized``, preset ``MXFP8A16``; ModelOpt ``quant_algo:
  MXFP8``): an FP8 ``<p>.weight`` ``(..., M, N)`` with ``<p>.weight_scale`` uint8 ``(..., M,
  N / 32)`` -- linked in :mod:`.fp8_scales` through :func:`mx_grid_shape`.

The shape tells MXFP4 from MXFP6: a packed width ``K`` with ``G`` scales per row is MXFP4 when
``K = 16 G``, MXFP6 when ``K = 24 G``. Anything else -- a ragged last block (``N`` not a
multiple of 32: no library above writes one, and the OCP MX spec has none), leading dimensions
that differ, gpt-oss blocks not 16 bytes wide -- is refused in one line naming both tensors.

Values, per element: ``float32(decode(code) * 2 ** (e - 127))``, the exact product (E2M1, E2M3
and E4M3 values times a power of two in ``[2**-127, 2**127]`` are representable in float32, down
to ``2**-136``; products above float32's max are inf). The libraries compute the same product,
then round it to the model's dtype (bfloat16 in compressed-tensors' decompressor and by
default in transformers'); fp8sim analyzes the float32 values, before that cast. The E8M0 code
0xFF is NaN (OCP MX spec), so its block is NaN. The libraries read it as ``2 ** 128`` instead:
compressed-tensors 0.20 (in bfloat16) and ModelOpt (``exp2``, float32) as inf, so the block's
values are ``+-inf`` (NaN for zero codes, in ModelOpt); transformers' ``ldexp`` multiplies by
``2 ** 128`` exactly (0.5 becomes ``2 ** 127``, larger values inf). Such blocks are counted apart
in the tensor's note.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fp8sim.analysis.dumps.core import Dump, TensorSource
from fp8sim.analysis.dumps.fp8_companions import CompanionFinder
from fp8sim.analysis.dumps.fp4_scales import PackedCodes, PackedE2M1

__all__ = ["MX_BLOCK", "E8M0_DTYPES", "PackedE2M3", "MXWeight", "mx_packed", "mx_grid_shape"]

#: elements per MX block (OCP MX v1.0: k = 32)
MX_BLOCK = 32
#: companion dtypes read as E8M0 exponent codes (MX checkpoints store uint8)
E8M0_DTYPES = ("uint8", "float8_e8m0fnu")
#: (suffix of the packed codes, suffix of their scales): gpt-oss (Hugging Face, then OpenAI)
_GPT_OSS = (("_blocks", "_scales"), (".blocks", ".scales"))
_GPT_OSS_BYTES = 16  # bytes of one gpt-oss block: 32 E2M1 codes
_PACKED = "_packed"


@dataclass
class PackedE2M3(PackedCodes):
    """E2M3 codes four per three bytes (compressed-tensors' ``pack_fp6_to_uint8``): logical shape
    ``(..., 4 K / 3)`` for a packed ``(..., K)``."""

    FORMAT = "e2m3"
    PER_GROUP, GROUP_BYTES = 4, 3

    @classmethod
    def unpack(cls, raw: np.ndarray) -> np.ndarray:
        b = raw.reshape(-1, 3).astype(np.uint32)
        word = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        return ((word[:, None] >> np.uint32([0, 6, 12, 18])) & 0x3F).astype(np.uint8).reshape(-1)


@dataclass
class MXWeight:
    """A packed MX weight found by :func:`mx_packed`: ``layout`` (for notes), ``codes`` (its
    element values, logical shape), the E8M0 ``scale`` companion and its ``owner`` dump."""

    layout: str
    codes: TensorSource
    scale: TensorSource
    owner: Dump

    @property
    def element(self) -> str:
        return "E2M3" if isinstance(self.codes, PackedE2M3) else "E2M1"


def _scale_name(name: str) -> tuple[str, str] | None:
    """(layout, scale companion name) of a uint8 tensor that may be packed MX codes."""
    for blocks, scales in _GPT_OSS:
        if name.endswith(blocks):
            return "gpt-oss", name[: -len(blocks)] + scales
    if name.endswith("weight" + _PACKED):
        return "compressed-tensors", name[: -len(_PACKED)] + "_scale"
    if name.endswith("weight"):
        return "modelopt", name + "_scale"
    return None


def mx_packed(src: TensorSource, dump: Dump, finder: CompanionFinder) -> MXWeight | None:
    """For a uint8 tensor: an :class:`MXWeight` when it has an E8M0 scale companion (uint8 or
    ``float8_e8m0fnu``) named as one of the layouts in the module docstring, else None (an NVFP4
    weight's scale is E4M3). Raises ValueError ``"<what is wrong>"`` (the caller names the file
    and tensor) for shapes that do not fit, and as :meth:`CompanionFinder.find` does."""
    guess = _scale_name(src.name)
    if guess is None:
        return None
    layout, scale_name = guess
    found = finder.find(src, dump, [scale_name])
    if found is None:
        return None
    owner, scale = found
    if not isinstance(scale, TensorSource):
        raise ValueError(f"has its companion {scale[0]} in {owner.path}, which cannot be used: "
                         f"{scale[1]}")  # fmt: skip
    if scale.dtype not in E8M0_DTYPES:
        return None
    if layout != "gpt-oss" and _has_nvfp4_scale(src, dump, finder, layout):
        return None  # NVFP4 with a uint8 block scale: refused by the NVFP4 rules
    shape, s_shape = tuple(src.shape), tuple(scale.shape)
    where = f"{scale.name} shape {list(s_shape)} does not fit {src.name} shape {list(shape)}"
    if layout == "gpt-oss":
        if len(shape) < 3 or shape[-1] != _GPT_OSS_BYTES or s_shape != shape[:-1]:
            raise ValueError(f"{where}: gpt-oss MXFP4 blocks are (..., rows, G, 16) uint8 with "
                             "scales (..., rows, G)")  # fmt: skip
        logical = (*shape[:-2], shape[-2] * MX_BLOCK)
        return MXWeight(layout, PackedE2M1(src.name, src.file, logical, "float4_e2m1fn", None,
                                           base=src), scale, owner)  # fmt: skip
    if len(shape) < 2 or len(s_shape) != len(shape) or s_shape[:-1] != shape[:-1]:
        raise ValueError(f"{where}: expected [{', '.join(map(str, shape[:-1]))}, G], one E8M0 "
                         "scale per 32 elements")  # fmt: skip
    k, g = shape[-1], s_shape[-1]
    if k == 16 * g:
        return MXWeight(f"{layout} MXFP4", PackedE2M1(src.name, src.file, (*shape[:-1], 2 * k),
                                                      "float4_e2m1fn", None, base=src),
                        scale, owner)  # fmt: skip
    if k == 24 * g and layout == "compressed-tensors":
        return MXWeight(f"{layout} MXFP6", PackedE2M3(src.name, src.file, (*shape[:-1], 4 * k // 3),
                                                      "float6_e2m3fn", None, base=src),
                        scale, owner)  # fmt: skip
    fp6 = f" or [..., {k / 24:g}] (MXFP6: 4 codes in 3 bytes)" if layout == "compressed-tensors" else ""
    raise ValueError(f"{where}: expected [..., {k / 16:g}] (MXFP4: 2 codes per byte){fp6}, one "
                     "E8M0 scale per 32 elements; MX blocks are never ragged")  # fmt: skip


def _has_nvfp4_scale(src: TensorSource, dump: Dump, finder: CompanionFinder, layout: str) -> bool:
    """Whether the packed weight also has NVFP4's per-tensor scale (then it is no MX weight)."""
    second = src.name[: -len(_PACKED)] + "_global_scale" if layout == "compressed-tensors" \
        else src.name + "_scale_2"  # fmt: skip
    try:
        return finder.find(src, dump, [second]) is not None
    except ValueError:
        return False


def mx_grid_shape(w_shape: tuple[int, ...], s_shape: tuple[int, ...]) -> str | None:
    """Why an E8M0 scale of shape ``s_shape`` is not one per 32 elements along the last axis of
    an FP8 weight of ``w_shape`` (MXFP8), or None when it is."""
    if len(w_shape) < 2 or len(s_shape) != len(w_shape) or s_shape[:-1] != w_shape[:-1]:
        return f"expected [{', '.join(map(str, w_shape[:-1]))}, N / 32] (MXFP8)"
    n = w_shape[-1]
    if n % MX_BLOCK:
        return (f"MXFP8 blocks hold 32 elements and the weight's last dimension {n} is not a "
                "multiple of 32 (MX blocks are never ragged)")  # fmt: skip
    if s_shape[-1] != n // MX_BLOCK:
        return f"expected [{', '.join(map(str, w_shape[:-1]))}, {n // MX_BLOCK}] (MXFP8)"
    return None

"""The bit-exact emulator: ``encode``, ``decode``, ``quantize`` -- the oracle of fp8sim.

Semantics (the contract in docs/numerics.md):

* Inputs: numpy float16, bfloat16 (ml_dtypes), float32, float64 arrays, Python floats, or CPU
  torch tensors (torch in -> torch out), any shape, any strides. Each value is rounded once,
  directly from its own bits: float16/bfloat16 widen exactly to float32, float64 is rounded from
  its 53-bit significand (never through float32).
* ``rounding``: one of :data:`ROUNDING_MODES` (see ``fp8sim._numba.encode_core`` for the exact rules).
* ``saturate=True``: finite overflow and +-inf become +-max, NaN stays NaN. ``saturate=False``
  (OCP "non-saturating"): overflow becomes +-inf where the format has inf, else NaN; modes that
  round toward zero at that sign never overflow (``rtz``, ``odd``, ``up`` < 0, ``down`` > 0).
* Zeros: signed zero is kept where the format has -0; FNUZ formats map -0 to +0; E8M0 has no
  zero (0 and anything below 2**-127 encode as 2**-127, negative numbers as NaN).
* NaN input gives the format's canonical NaN, keeping the input's sign where the format can
  (FNUZ: 0x80). Formats with no NaN (e2m1, e2m3, e3m2) raise ValueError on a NaN input, and on
  an overflow or inf unless ``saturate=True``; the message gives the count and first index.
* Stochastic rounding uses ``srbits=k`` (1..32, default 32) random bits per element: the top
  ``k`` bits of ``rbits`` (uint32, one per element) or of Philox4x32-10 keyed by ``seed`` with
  counter = flat C-order element index -- the stream of ``tl.randint(seed, offsets)`` with
  int32 offsets (the counter wraps modulo 2**32: tensors past 4G elements repeat draws).
* Every result is a fresh numpy array; ``encode(..., out=)`` writes into a given one instead
  (a loop that casts tensors of one size saves the allocation that way).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from fp8sim._numba import encode_core as core
from fp8sim._numba.jit import PARALLEL_MIN_ELEMENTS
from fp8sim.formats import ROUNDING_MODES, FloatFormat, get_format
from fp8sim.philox import seed_words

__all__ = [
    "ROUNDING_MODES",
    "ROUNDING_IDS",
    "encode",
    "decode",
    "quantize",
    "format_params",
    "decode_table",
    "as_float_array",
]

ROUNDING_IDS = {name: i for i, name in enumerate(ROUNDING_MODES)}
_NAN_KIND_IDS = {"ieee": core.NAN_IEEE, "fn": core.NAN_FN, "fnuz": core.NAN_FNUZ,
                 "none": core.NAN_NONE}


@functools.lru_cache(maxsize=None)
def format_params(fmt: FloatFormat | str) -> core.FormatParams:
    """The named tuple of ints that numba kernels take instead of the dataclass:
    ``(mantissa_bits, emin, max_code, sign_mask, signed, has_subnormals, nan_kind, nan_code,
    inf_code)`` (see :class:`fp8sim._numba.encode_core.FormatParams`).
    """
    fmt = get_format(fmt)
    return core.FormatParams(
        fmt.mantissa_bits,
        fmt.emin,
        fmt.max_code,
        fmt.sign_mask,
        int(fmt.signed),
        int(fmt.has_subnormals),
        _NAN_KIND_IDS[fmt.nan],
        -1 if fmt.nan_code is None else fmt.nan_code,
        -1 if fmt.inf_code is None else fmt.inf_code,
    )


def _decode_code(fmt: FloatFormat, code: int) -> float:
    """Exact value of one code (Python float), from the field definitions."""
    mag_mask = (1 << fmt.magnitude_bits) - 1
    neg = fmt.signed and (code >> fmt.magnitude_bits) & 1
    mag = code & mag_mask
    if fmt.is_nan_code(code):  # the code's sign, as torch and ml_dtypes; FNUZ's one NaN: +NaN
        return -math.nan if neg and fmt.nan != "fnuz" else math.nan
    if fmt.has_inf and mag == fmt.inf_code:
        return float("-inf") if neg else float("inf")
    biased = mag >> fmt.mantissa_bits
    mant = mag & ((1 << fmt.mantissa_bits) - 1)
    if fmt.has_subnormals and biased == 0:
        value = mant * 2.0 ** (fmt.emin - fmt.mantissa_bits)
    else:
        value = (2.0**fmt.mantissa_bits + mant) * 2.0 ** (
            biased - fmt.bias - fmt.mantissa_bits
        )
    return -value if neg else value


@functools.lru_cache(maxsize=None)
def _decode_table_cached(fmt: FloatFormat, dtype_name: str) -> np.ndarray:
    table = np.array([_decode_code(fmt, c) for c in range(fmt.num_codes)], dtype=np.float64)
    out = table.astype(np.dtype(dtype_name))
    # every code is exact in float32 (<= 8 exponent bits, <= 16 bits) -- check, never assume
    finite = np.isfinite(table)
    if not np.array_equal(out[finite].astype(np.float64), table[finite]):
        raise ValueError(f"{fmt.name}: some values are not exact in {dtype_name}")
    out.setflags(write=False)
    return out


def decode_table(fmt: FloatFormat | str, dtype: Any = np.float64) -> np.ndarray:
    """Read-only array: the value of every code of ``fmt`` (index = code), NaN for NaN codes."""
    fmt = get_format(fmt)
    return _decode_table_cached(fmt, np.dtype(dtype).name)


# -- input handling ---------------------------------------------------------------------------


def is_torch_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def as_float_array(x: Any, what: str = "x") -> tuple[np.ndarray, bool]:
    """``(array, came_from_torch)``: ``x`` as a float32 or float64 numpy array, no rounding.

    float16 and bfloat16 (ml_dtypes or torch) widen exactly to float32; float32/float64 pass
    through (no copy when possible). Integer, complex or other inputs raise TypeError.
    """
    from_torch = is_torch_tensor(x)
    if from_torch:
        import torch

        t = x.detach()
        if t.device.type != "cpu":
            raise TypeError(f"{what}: the emulator takes CPU tensors, got device {t.device}")
        if t.dtype == torch.bfloat16:
            bits = t.contiguous().view(torch.int16).numpy().view(np.uint16)
            arr = (bits.astype(np.uint32) << 16).view(np.float32)
            return arr, True
        if not (t.dtype.is_floating_point) or t.dtype.itemsize == 1:
            raise TypeError(
                f"{what}: expected a float16/bfloat16/float32/float64 tensor, got {t.dtype}"
            )
        arr = t.contiguous().numpy()
    else:
        arr = np.asarray(x)
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))  # same values, native byte order
    dt = arr.dtype
    if dt.name == "bfloat16":
        bits = np.ascontiguousarray(arr).view(np.uint16)
        return (bits.astype(np.uint32) << 16).view(np.float32), from_torch
    if dt == np.float16:
        return arr.astype(np.float32), from_torch
    if dt in (np.float32, np.float64):
        return arr, from_torch
    raise TypeError(
        f"{what}: expected float16, bfloat16, float32 or float64 values, got dtype {dt} "
        "(integer codes go to decode(); pass bfloat16 bits as ml_dtypes.bfloat16, not uint16)"
    )


def _check_rounding(rounding: str) -> int:
    if rounding not in ROUNDING_IDS:
        raise ValueError(
            f"unknown rounding {rounding!r}; valid: {', '.join(ROUNDING_MODES)}"
        )
    return ROUNDING_IDS[rounding]


def _stochastic_inputs(
    n: int, shape: tuple, rounding: str, rbits: Any, srbits: int | None, seed: int | None
) -> tuple[np.ndarray, bool, int, int, int]:
    """(rbits_flat, use_rbits, k0, k1, k) for the kernels."""
    k = 32 if srbits is None else srbits
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= 32:
        raise ValueError(f"srbits must be an int in 1..32, got {srbits!r}")
    empty = np.zeros(0, dtype=np.uint32)
    if rounding != "stochastic":
        if rbits is not None or seed is not None or srbits is not None:
            raise ValueError(f"rbits/srbits/seed are for rounding='stochastic', not {rounding!r}")
        return empty, False, 0, 0, int(k)
    if (rbits is None) == (seed is None):
        raise ValueError("stochastic rounding needs exactly one of rbits= or seed=")
    if rbits is not None:
        if is_torch_tensor(rbits):
            rbits = rbits.detach().cpu().numpy()
        rb = np.asarray(rbits)
        if not rb.dtype.isnative:
            rb = rb.astype(rb.dtype.newbyteorder("="))
        if rb.dtype not in (np.uint32, np.int32):
            raise TypeError(f"rbits must be uint32 (one word per element), got {rb.dtype}")
        if rb.shape != shape:
            raise ValueError(f"rbits shape {rb.shape} does not match x shape {shape}")
        return np.ascontiguousarray(rb.view(np.uint32)).reshape(-1), True, 0, 0, int(k)
    k0, k1 = seed_words(seed)
    return empty, False, k0, k1, int(k)


def _raise_status(status: np.ndarray, fmt: FloatFormat, shape: tuple) -> None:
    bad = np.flatnonzero(status)
    if bad.size == 0:
        return
    nan_idx = bad[status[bad] == -core.ERR_NAN]  # the kernels store -ERR_NAN / -ERR_OVERFLOW
    if nan_idx.size:
        first = np.unravel_index(int(nan_idx[0]), shape) if shape else ()
        raise ValueError(
            f"{nan_idx.size} NaN input(s) but {fmt.name} has no NaN encoding "
            f"(first at index {tuple(int(i) for i in first)})"
        )
    first = np.unravel_index(int(bad[0]), shape) if shape else ()
    raise ValueError(
        f"{bad.size} value(s) overflow {fmt.name} (max {fmt.max}), which has no inf/NaN; "
        f"use saturate=True (first at index {tuple(int(i) for i in first)})"
    )


def _fast_path_ok(fmt: FloatFormat, dtype: np.dtype) -> bool:
    """Whether the branch-free kernel applies (see ``encode_core.encode_fast``)."""
    emin_floor = -126 if dtype == np.float32 else -1022
    return fmt.signed and fmt.has_subnormals and fmt.has_nan and fmt.emin >= emin_floor


def _encode_numpy(
    arr: np.ndarray,
    fmt: FloatFormat,
    rounding: str,
    saturate: bool,
    rbits: Any,
    srbits: int | None,
    seed: int | None,
    allow_fast: bool = True,
    out: np.ndarray | None = None,
    fpu: bool = True,
) -> np.ndarray:
    """Encode a float32/float64 array. ``allow_fast=False`` forces the general kernels,
    ``fpu=False`` the integer float32 RNE kernel where the FPU one would serve (the tests run
    every kernel on the same inputs). ``out``: a checked destination (see
    :func:`_check_out`), written in place and returned."""
    if not isinstance(saturate, (bool, np.bool_)):
        raise TypeError(f"saturate must be True or False, got {saturate!r}")
    mode = _check_rounding(rounding)
    shape = arr.shape
    flat = np.ascontiguousarray(arr).reshape(-1)
    rb, use_rbits, k0, k1, k = _stochastic_inputs(flat.size, shape, rounding, rbits, srbits, seed)
    dest = out
    out = np.empty(flat.size, fmt.code_dtype) if dest is None else dest.reshape(-1)
    status = np.zeros(flat.size if fmt.nan == "none" else 0, dtype=np.uint8)
    params = format_params(fmt)
    big = flat.size >= PARALLEL_MIN_ELEMENTS
    if allow_fast and _fast_path_ok(fmt, flat.dtype) and flat.dtype == np.float32 and mode == ROUNDING_IDS["rne"] \
            and fmt.mantissa_bits <= 22:
        # round to nearest even from float32: the 32-bit-lane kernels (one FPU add where the
        # format allows it, else integer operations only)
        m, emin_b = fmt.mantissa_bits, fmt.emin + 127
        over = fmt.max_code if saturate else (fmt.inf_code if fmt.has_inf else fmt.nan_code)
        if fpu and core.fpu_rne_ok(fmt.emin, fmt.emax, m):
            kernel = core.encode_f32_rne_fpu_kernel if big else core.encode_f32_rne_fpu_kernel_serial
            kernel(flat, out, 23 - m, (emin_b - 1) << m, emin_b << 23, np.float32(2.0 ** (fmt.emin - m + 23)),
                   fmt.max_code, over, fmt.nan_code, fmt.nan == "fnuz", fmt.magnitude_bits)
            return out.reshape(shape)
        kernel = core.encode_f32_rne_kernel if big else core.encode_f32_rne_kernel_serial
        kernel(flat.view(np.uint32), out, 23 - m, (emin_b - 1) << m, emin_b << 23, emin_b,
               fmt.max_code, over, fmt.nan_code, fmt.nan == "fnuz", fmt.magnitude_bits)
        return out.reshape(shape)
    if allow_fast and _fast_path_ok(fmt, flat.dtype):
        over = fmt.inf_code if fmt.has_inf else fmt.nan_code
        if flat.dtype == np.float32:
            bits, p, emax_in, bias_in = flat.view(np.uint32), 23, 0xFF, 127
        else:
            bits, p, emax_in, bias_in = flat.view(np.uint64), 52, 0x7FF, 1023
        core.encode_fast(
            bits, out, p, emax_in, bias_in, fmt.mantissa_bits, fmt.emin, fmt.max_code,
            fmt.magnitude_bits, over, fmt.nan_code, fmt.nan == "fnuz", mode, bool(saturate),
            rb, use_rbits, np.uint64(k0), np.uint64(k1), k, big,
        )
        return out.reshape(shape)
    if flat.dtype == np.float32:
        kernel = core.encode_f32_kernel if big else core.encode_f32_kernel_serial
        bits = flat.view(np.uint32)
    else:
        kernel = core.encode_f64_kernel if big else core.encode_f64_kernel_serial
        bits = flat.view(np.uint64)
    kernel(
        bits, out, status, params, mode, bool(saturate), rb, use_rbits,
        np.uint64(k0), np.uint64(k1), k,
    )
    if status.size:
        _raise_status(status, fmt, shape)
    return out.reshape(shape)


def _check_out(out: Any, arr: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    """``out`` as a numpy array the encoder may write: a numpy array or CPU torch tensor of the
    code dtype (uint8 / uint16), ``arr``'s shape, C-contiguous, writable, not sharing memory
    with the input. Anything else is refused (TypeError / ValueError), never silently copied."""
    if hasattr(out, "device") and hasattr(out, "numpy"):  # a torch tensor
        import torch

        if out.device.type != "cpu":
            raise ValueError(f"encode: out must be a CPU tensor, got one on {out.device}")
        t = out.detach()
        if t.dtype.is_floating_point:  # a torch tensor of this very format: codes are its bits
            try:
                same = get_format(str(t.dtype).removeprefix("torch.")) == fmt
            except ValueError:  # a torch dtype that is no format of ours (e.g. float4_e2m1fn_x2)
                same = False
            if not same:
                raise TypeError(f"encode: out of dtype {t.dtype} cannot hold {fmt.name} codes "
                                f"(give a torch tensor of that format's dtype or a uint8/uint16 array)")
            t = t.view(torch.uint8 if t.element_size() == 1 else torch.uint16)
        out = t.numpy()
    if not isinstance(out, np.ndarray):
        raise TypeError(f"encode: out must be a numpy array or CPU torch tensor, got {type(out).__name__}")
    if out.dtype != fmt.code_dtype:
        raise TypeError(f"encode: out must have dtype {np.dtype(fmt.code_dtype).name} for {fmt.name}, got {out.dtype}")
    if out.shape != arr.shape:
        raise ValueError(f"encode: out has shape {out.shape}, the input {arr.shape}")
    if not (out.flags.c_contiguous and out.flags.writeable):
        raise ValueError("encode: out must be C-contiguous and writable")
    if np.shares_memory(out, arr):
        raise ValueError("encode: out shares memory with the input")
    return out


def encode(
    x: Any,
    fmt: FloatFormat | str,
    *,
    rounding: str = "rne",
    saturate: bool = True,
    rbits: Any = None,
    srbits: int | None = None,
    seed: int | None = None,
    out: Any = None,
) -> Any:
    """Codes of ``x`` in ``fmt`` (uint8, or uint16 for formats wider than 8 bits).

    See the module docstring for the rounding, overflow, zero and NaN rules. Returns a numpy
    array of ``x``'s shape, or a torch tensor (torch.uint8 / torch.uint16) for a torch input.
    ``out``: write the codes into this array or CPU tensor instead (code dtype -- or the torch
    float8 dtype of this very format --, ``x``'s shape, C-contiguous; saves the allocation when
    encoding repeatedly) and return it. If encoding raises (e.g. NaN into a format without NaN),
    ``out``'s contents are unspecified.
    """
    fmt = get_format(fmt)
    arr, from_torch = as_float_array(x)
    if out is not None:
        target = out
        _encode_numpy(arr, fmt, rounding, saturate, rbits, srbits, seed, out=_check_out(out, arr, fmt))
        return target
    codes = _encode_numpy(arr, fmt, rounding, saturate, rbits, srbits, seed)
    if from_torch:
        import torch

        return torch.from_numpy(codes)
    return codes


def decode(codes: Any, fmt: FloatFormat | str, *, dtype: Any = np.float32) -> Any:
    """Exact values of ``codes`` as ``dtype`` (float32 default; float64 also exact).

    ``codes`` must be an unsigned integer array (uint8/uint16, or int8/int16 bit views) whose
    values lie below ``2**fmt.bits``. torch in -> torch out. A NaN code decodes to a quiet NaN
    with the code's sign bit (as torch and ml_dtypes do); FNUZ's one NaN (0x80) to +NaN (as
    torch; ml_dtypes gives -NaN).
    """
    fmt = get_format(fmt)
    from_torch = is_torch_tensor(codes)
    if from_torch:
        import torch

        t = codes.detach()
        if t.dtype.is_floating_point and t.dtype.itemsize == 1:
            t = t.view(torch.uint8)  # a torch float8 tensor: its bits are the codes
        if t.dtype not in (torch.uint8, torch.int8, torch.uint16, torch.int16):
            raise TypeError(f"codes must be a uint8/uint16 tensor, got {t.dtype}")
        if t.dtype in (torch.uint16, torch.int16):
            arr = t.contiguous().view(torch.int16).numpy().view(np.uint16)
        else:
            arr = t.contiguous().view(torch.uint8).numpy()
    else:
        arr = np.asarray(codes)
        if arr.dtype.kind not in "ui":
            raise TypeError(f"codes must be an unsigned integer array, got dtype {arr.dtype}")
        if not arr.dtype.isnative:
            arr = arr.astype(arr.dtype.newbyteorder("="))
        if arr.dtype.kind == "i":
            if arr.size and int(arr.min()) < 0 and arr.dtype.itemsize > 2:
                i = int(np.argmax(arr.reshape(-1) < 0))
                raise ValueError(f"code {int(arr.reshape(-1)[i])} at flat index {i} is negative")
            arr = arr.view(np.dtype(f"u{arr.dtype.itemsize}"))
    if arr.dtype.itemsize > 2:
        arr = arr.astype(np.uint64)
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"decode dtype must be float32 or float64, got {dtype}")
    flat = np.ascontiguousarray(arr).reshape(-1)
    if flat.size and int(flat.max()) >= fmt.num_codes:
        i = int(np.argmax(flat >= fmt.num_codes))
        raise ValueError(
            f"code {int(flat[i])} at flat index {i} is out of range for {fmt.name} "
            f"({fmt.bits} bits)"
        )
    out = np.empty(flat.size, dtype)
    kernel = core.decode_kernel if flat.size >= PARALLEL_MIN_ELEMENTS else core.decode_kernel_serial
    kernel(flat, decode_table(fmt, dtype), out)
    out = out.reshape(arr.shape)
    if from_torch:
        import torch

        return torch.from_numpy(out)
    return out


def quantize(
    x: Any,
    fmt: FloatFormat | str,
    *,
    rounding: str = "rne",
    saturate: bool = True,
    rbits: Any = None,
    srbits: int | None = None,
    seed: int | None = None,
) -> Any:
    """``decode(encode(x))`` in ``x``'s own dtype (float16/bfloat16 results are cast back with
    round-to-nearest-even, exact whenever the format's values fit that dtype)."""
    fmt = get_format(fmt)
    arr, from_torch = as_float_array(x)
    codes = _encode_numpy(arr, fmt, rounding, saturate, rbits, srbits, seed)
    wide = np.float64 if arr.dtype == np.float64 else np.float32
    values = decode(codes, fmt, dtype=wide)
    if from_torch:
        import torch

        return torch.from_numpy(values).to(x.dtype)
    src = np.asarray(x).dtype
    if src.name == "bfloat16" or src == np.float16:
        return values.astype(src)
    if np.ndim(x) == 0 and not isinstance(x, np.ndarray):
        return values[()]
    return values

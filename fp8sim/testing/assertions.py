"""``assert_bitexact``: a user's cast against the emulator (and the helpers that
:mod:`fp8sim.testing.scaled` shares).

``assert_bitexact`` and ``assert_scaled_bitexact`` follow numpy.testing / torch.testing: they
return None when the cast agrees and raise AssertionError with a readable report when it does
not. A run has two parts:

1. fixed edge cases of the format (always; no hypothesis needed), every element checked at
   once, so the report counts all mismatches among them;
2. ``max_examples`` arrays drawn by hypothesis (:func:`fp8sim.testing.arrays`) searched with
   ``hypothesis.find`` for one the cast gets wrong, which hypothesis then shrinks to a small
   example before it is reported. ``max_examples=0`` skips this part (and hypothesis).

Draws are reproducible: ``hypothesis_seed`` (default 0) seeds them; ``None`` draws afresh.
Do not call these inside a ``@given`` test (hypothesis refuses nested searches); use the
strategies of :mod:`fp8sim.testing.strategies` there instead.
"""

from __future__ import annotations

import random
from typing import Any, Callable

import numpy as np

from fp8sim.backends.cases import edge_values, random_values
from fp8sim.emulator import is_torch_tensor, decode_table, encode
from fp8sim.formats import FloatFormat, get_format
from fp8sim.testing import _report as rep
from fp8sim.testing.strategies import HYPOTHESIS_HINT, as_dtype, arrays, tie_values

__all__ = ["assert_bitexact"]

# -- moving arrays in and out of the user's function ----------------------------------------


def to_input(x: np.ndarray, device: str | None) -> Any:
    """A copy of ``x`` for the user's function: numpy, or a torch tensor on ``device``."""
    if device is None:
        return x.copy()
    import torch

    if x.dtype.name == "bfloat16":
        t = torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
    else:
        t = torch.from_numpy(x.copy())
    return t.to(device)


def as_numpy(out: Any) -> np.ndarray:
    if is_torch_tensor(out):
        import torch

        t = out.detach().cpu()
        if t.dtype.itemsize == 1 and t.dtype != torch.uint8:
            t = t.view(torch.uint8)  # int8, float8_* dtypes: their bits
        elif t.dtype.itemsize == 2 and t.dtype != torch.int16 and not t.dtype.is_floating_point:
            t = t.to(torch.int32)  # uint16 has no numpy view in older torch
        elif t.dtype in (torch.float16, torch.bfloat16):
            t = t.view(torch.int16)
        return t.numpy()
    return np.asarray(out)


def received_codes(out: Any, fmt: FloatFormat, shape: tuple, what: str) -> np.ndarray:
    """The codes ``out`` (numpy or torch) as int64 of ``shape``: integers as they are; any other
    1- or 2-byte dtype (float8, float16, bfloat16, ml_dtypes types) read as its bits.
    TypeError or AssertionError when it cannot be codes."""
    arr = as_numpy(out)
    size = arr.dtype.itemsize
    if arr.dtype.kind == "b" or size > 2 and arr.dtype.kind not in "ui":
        raise TypeError(
            f"{what} must return codes (uint8, or uint16 for 16-bit formats; torch float8 "
            f"tensors are read as their bits), got {arr.dtype} -- to compare values, not codes, "
            "decode them with fp8sim.decode first"
        )
    if size in (1, 2) and arr.dtype.kind != "u":
        arr = arr.view(np.uint8 if size == 1 else np.uint16)
    if tuple(arr.shape) != tuple(shape):
        raise AssertionError(f"{what} returned codes of shape {tuple(arr.shape)}, expected "
                             f"{tuple(shape)} (the input's shape)")
    return arr.astype(np.int64)


def bad_codes(expected: np.ndarray, received: np.ndarray, fmt: FloatFormat,
               exact_nan: bool) -> np.ndarray:
    """Elements whose codes differ; any NaN code matches an expected NaN unless ``exact_nan``."""
    bad = expected.astype(np.int64) != received
    if not exact_nan and bad.any() and fmt.has_nan:
        table = decode_table(fmt, np.float64)
        valid = (received >= 0) & (received < fmt.num_codes)
        got = table[np.where(valid, received, 0)]
        bad &= ~(valid & np.isnan(got) & np.isnan(table[expected]))
    return bad


def _encodable(x: np.ndarray, fmt: FloatFormat, kw: dict) -> np.ndarray:
    """Mask of the elements ``encode`` accepts (formats without NaN refuse NaN, and inf or
    overflow unless saturating); checked element by element only where one could fail."""
    ok = np.ones(x.shape, bool)
    if fmt.has_nan:
        return ok
    x32 = np.asarray(x, np.float64)
    ok &= ~np.isnan(x32)
    if kw["saturate"] or kw["rounding"] == "stochastic":
        return ok  # stochastic: a flat-index stream; saturating: nothing else refuses
    for i in np.flatnonzero(ok & ~(np.abs(x32) <= fmt.max)):
        try:
            encode(x.reshape(-1)[i : i + 1], fmt, **kw)
        except ValueError:
            ok.reshape(-1)[i] = False
    return ok


def _ties_in_dtype(fmt: FloatFormat, dtype: np.dtype) -> np.ndarray:
    """The ties of ``fmt`` and their neighbours one ulp of ``dtype`` away, in ``dtype`` (for
    float64 inputs these lie between float32 values: a cast through float32 double-rounds
    them; float32's own neighbours are among the edge cases already)."""
    t = tie_values(fmt)
    t = as_dtype(t[np.isfinite(t)].astype(np.float64), dtype)
    with np.errstate(all="ignore"):
        zero, inf = np.zeros(1, dtype), np.full(1, np.inf, dtype)
        return np.concatenate([t, np.nextafter(t, zero), np.nextafter(t, inf),
                               np.nextafter(t, -inf)])


def check_hypothesis() -> Any:
    try:
        import hypothesis
    except ImportError as exc:
        raise ImportError(
            f"{HYPOTHESIS_HINT}; or pass max_examples=0 to check the fixed edge cases only"
        ) from exc
    return hypothesis


def find_failing(strategy: Any, fails: Callable[[np.ndarray], bool], max_examples: int,
          hypothesis_seed: int | None, name: str) -> np.ndarray | None:
    """A (shrunk) draw of ``strategy`` on which ``fails`` is true, or None after
    ``max_examples`` draws."""
    hypothesis = check_hypothesis()
    from hypothesis.errors import Flaky, NoSuchExample

    settings = hypothesis.settings(
        max_examples=max_examples, database=None, deadline=None,
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    rnd = None if hypothesis_seed is None else random.Random(hypothesis_seed)
    try:
        return hypothesis.find(strategy, fails, settings=settings, random=rnd)
    except NoSuchExample:
        return None
    except Flaky:  # wrong once, right when hypothesis called it again on the same draw
        not_deterministic(name)


def not_deterministic(name: str) -> None:
    """The search found an input ``name`` got wrong, but the rerun on it agreed."""
    raise AssertionError(f"{name} gave a wrong result on an array drawn by hypothesis but the "
                         "right one when called again on it: its results are not deterministic")


def call_repr(name: str, fmt: FloatFormat, kw: dict, extra: str = "") -> str:
    opts = ", ".join(f"{k}={v!r}" for k, v in kw.items() if v is not None)
    return f"{name}(x, {fmt.name!r}{extra}, {opts})"


# -- unscaled casts ---------------------------------------------------------------------------


def code_rows(x: np.ndarray, expected: np.ndarray, received: np.ndarray, bad: np.ndarray,
               fmt: FloatFormat, max_report: int, product: np.ndarray | None = None) -> str:
    flat = np.flatnonzero(bad)
    header = ["index", "input"] + (["x * scale (float32)"] if product is not None else []) + [
        "expected", "received"]
    rows = []
    xs, es, rs = x.reshape(-1), expected.reshape(-1), received.reshape(-1)
    for i in flat[:max_report]:
        row = [rep.index_str(int(i), x.shape), rep.describe_float(xs[i])]
        if product is not None:
            row.append(rep.describe_float(product.reshape(-1)[i]))
        rows += [row + [rep.describe_code(int(es[i]), fmt), rep.describe_code(int(rs[i]), fmt)]]
    shown = f"first {len(rows)}" if flat.size > len(rows) else "all"
    return (f"Mismatched codes: {flat.size} of {bad.size} ({100 * flat.size / bad.size:.3g}%); "
            f"{shown}:\n" + rep.table(header, rows))


def check_search_args(max_examples: Any, hypothesis_seed: Any, max_report: Any, exact_nan: Any) -> None:
    """:class:`~fp8sim.errors.ArgumentError` naming the argument unless ``max_examples`` is an
    int >= 0 (a negative count would skip the search silently), ``hypothesis_seed`` an int or
    None, ``max_report`` an int >= 1 and ``exact_nan`` True or False."""
    from fp8sim.errors import ArgumentError, expect_bool, expect_int

    expect_int(max_examples, "max_examples", lowest=0)
    if hypothesis_seed is not None and (isinstance(hypothesis_seed, bool) or not isinstance(hypothesis_seed, int)):
        raise ArgumentError.about("hypothesis_seed", f" must be an integer or None, got {hypothesis_seed!r:.40}")
    expect_int(max_report, "max_report", lowest=1)
    expect_bool(exact_nan, "exact_nan")


def search_draws(strategy: Any, check: Callable[..., bool], max_examples: int,
                 hypothesis_seed: int | None, name: str, what: str) -> None:
    """Let hypothesis look for a draw ``check`` fails on; report the shrunk one through
    ``check`` (which raises), or say the cast is not deterministic if it passes on the rerun."""
    found = find_failing(strategy, lambda a: check(a, "", raise_=False), max_examples,
                         hypothesis_seed, name)
    if found is not None:
        check(found, f"{what} (shrunk; hypothesis_seed={hypothesis_seed})")
        not_deterministic(name)


def assert_bitexact(
    fn: Callable[[Any], Any],
    fmt: FloatFormat | str,
    *,
    rounding: str = "rne",
    saturate: bool = True,
    seed: int | None = None,
    srbits: int | None = None,
    dtype: Any = np.float32,
    device: str | None = None,
    inputs: Any = None,
    max_examples: int = 100,
    hypothesis_seed: int | None = 0,
    exact_nan: bool = False,
    max_report: int = 8,
    msg: str | Callable[[str], str] | None = None,
) -> None:
    """Assert that ``fn(x)`` returns ``fp8sim.encode(x, fmt, rounding=..., saturate=...)``
    bit for bit, on the edge cases of ``fmt`` and on hypothesis draws.

    ``fn`` takes an array of ``dtype`` (float32 by default; float16, float64 or bfloat16 --
    ``ml_dtypes.bfloat16`` or ``"bfloat16"``) and returns the codes, same shape: a numpy
    array or torch tensor of uint8 (uint16 for 16-bit formats), or of any 1- or 2-byte dtype
    read as its bits -- so ``lambda x: x.to(torch.float8_e4m3fn)`` works as is. With
    ``device=None`` ``fn`` gets numpy arrays; with ``device="cpu"``/``"cuda"`` torch tensors
    on that device. Each call gets a fresh copy.

    Inputs, flattened to 1-D: ``inputs`` (an array or a list of arrays) if given, first, so
    its mismatches head the report; :func:`fp8sim.backends.cases.edge_values` (every code,
    every tie between neighbours, one float32 ulp either side of each, the overflow tie past
    max, the underflow tie with zero, float32 subnormals and huge values, +-0, +-inf, NaN --
    both signs); the ties and their neighbours one ulp of ``dtype`` away (float64: between
    float32 values, where a cast through float32 double-rounds); 256 random values over many
    binades. Then ``max_examples`` draws of :func:`fp8sim.testing.arrays` (1-D, up to 64
    elements). A format with no NaN (e2m1, e2m3, e3m2) leaves out what ``encode`` refuses
    (NaN; inf and overflow unless ``saturate``). ``rounding="stochastic"`` needs ``seed``
    (and ``srbits``) as for ``encode``: Philox keyed by ``seed``, counter = flat element
    index.

    A NaN code matches any NaN code (payloads carry no meaning) unless ``exact_nan``.
    On a mismatch: AssertionError listing the count and the first ``max_report`` mismatches
    (index, input value and bits, expected and received code in hex, sign.exponent.mantissa
    and decoded value). ``msg``: a string put above the report, or a callable that gets the
    report and returns the message. A bad argument (``max_examples=-1``) raises
    :class:`~fp8sim.errors.ArgumentError` naming it.
    """
    check_search_args(max_examples, hypothesis_seed, max_report, exact_nan)
    fmt = get_format(fmt)
    kw = dict(rounding=rounding, saturate=saturate, seed=seed, srbits=srbits)
    call = call_repr("fp8sim.encode", fmt, kw)
    dtype = np.dtype(as_dtype(np.zeros(0), dtype).dtype)
    name = getattr(fn, "__name__", "fn")

    def check(x: np.ndarray, where: str, raise_: bool = True) -> bool:
        x = x.reshape(-1)
        x = x[_encodable(x, fmt, kw)]
        expected = encode(x, fmt, **kw)
        received = received_codes(fn(to_input(x, device)), fmt, x.shape, name)
        bad = bad_codes(expected, received, fmt, exact_nan)
        if not bad.any():
            return False
        if raise_:
            report = (f"{name} is not bit-exact to {call}\non {where}.\n"
                      + code_rows(x, expected, received, bad, fmt, max_report))
            raise AssertionError(rep.with_msg(report, msg))
        return True

    fixed = [] if inputs is None else [np.asarray(a) for a in (
        inputs if isinstance(inputs, (list, tuple)) else [inputs])]
    fixed += [edge_values(fmt), _ties_in_dtype(fmt, dtype), random_values(256, seed=0)]
    x = np.concatenate([as_dtype(np.asarray(a, np.float64).reshape(-1), dtype) for a in fixed])
    check(x, f"{x.size} fixed {dtype.name} inputs ({'your inputs, ' if inputs is not None else ''}"
             f"the edge cases of {fmt.name}, 256 random values)")
    if max_examples > 0:
        check_hypothesis()
        from hypothesis import strategies as st

        strategy = arrays(fmt, st.tuples(st.integers(1, 64)), dtype=dtype)
        search_draws(strategy, check, max_examples, hypothesis_seed, name,
                     f"a {dtype.name} array drawn by hypothesis")

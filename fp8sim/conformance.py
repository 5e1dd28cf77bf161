"""Conformance: other libraries' float -> narrow-format casts, judged by the emulator.

Each check casts the same inputs with a library (torch native float8 dtypes, ml_dtypes, Triton's
``.to(tl.float8e4nv / tl.float8e5)``) and with the emulator under round-to-nearest-even, once
saturating and once not. A library agrees with an overflow rule when every code matches (NaN
codes match when both are NaN: payloads carry no meaning). The verdict names the rule a library
follows -- or says it follows neither, with the first inputs where it departs.

Inputs: every float16 value (``float16-all``) and a float32 sweep of bit patterns spread over the
whole range plus every tie and boundary of the format (``float32-sweep``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from fp8sim.emulator import decode, decode_table, encode
from fp8sim.formats import FloatFormat, get_format

__all__ = ["CheckResult", "run_conformance", "float32_sweep", "float16_all", "available_casts",
           "untested_libraries", "LIBRARIES"]

#: the libraries whose casts conformance checks (Triton's natively on a GPU, else in its interpreter)
LIBRARIES = ("torch", "ml_dtypes", "triton")


#: documented semantic differences: (library, type) -> (why, predicate of the inputs it covers).
#: Those inputs are left out of the verdict and counted in ``excluded``; the rest must agree.
KNOWN_DIFFERENCES: dict[tuple[str, str], tuple[str, Callable[[np.ndarray], np.ndarray]]] = {
    ("ml_dtypes", "float8_e8m0fnu"): (
        "0 -> NaN in ml_dtypes; E8M0 has no zero and fp8sim gives 2**-127, as torch does",
        lambda x: x == 0,
    ),
    ("torch", "float8_e8m0fnu"): (
        "torch drops the sign of negative inputs (-x -> +x; fp8sim: NaN, E8M0 is unsigned) and "
        "rounds float32-subnormal inputs up to 2**-126",
        lambda x: (x < 0) | ((x != 0) & (np.abs(x) < np.float32(2.0**-126))),
    ),
}


@dataclass
class CheckResult:
    library: str
    target: str  # the library's type name
    fmt: str  # our format name
    inputs: str
    n: int
    agree_saturating: int
    agree_nonsaturating: int
    verdict: str
    first_disagreements: list[dict] = field(default_factory=list)  # vs the closer rule
    error: str | None = None
    excluded: int = 0  # inputs left out for a documented difference (see ``note``)
    note: str | None = None

    def as_dict(self) -> dict:
        return self.__dict__.copy()


def float16_all() -> np.ndarray:
    """Every float16 bit pattern, widened exactly to float32."""
    return np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)


def float32_sweep(n_patterns: int, fmt: FloatFormat) -> np.ndarray:
    """``n_patterns`` float32 bit patterns spread evenly over all 2**32, plus for ``fmt`` every
    value, every tie (midpoint, including the one just above max), half the smallest subnormal,
    and their float32 neighbours, both signs."""
    step = max(1, (1 << 32) // n_patterns)
    pats = np.arange(0, 1 << 32, step, dtype=np.uint64)
    pats = (pats + (pats * np.uint64(2654435761)) % np.uint64(step)).astype(np.uint32)
    mags = decode_table(fmt, np.float64)[: fmt.max_code + 1]
    nxt = 2 * mags[-1] - mags[-2] if fmt.mantissa_bits else 2 * mags[-1]
    mags = np.append(mags, nxt)
    pts = np.concatenate([mags, (mags[:-1] + mags[1:]) / 2, [fmt.min_subnormal / 2]])
    pts = pts[pts < 3e38].astype(np.float32)
    near = np.concatenate([pts, np.nextafter(pts, np.float32(0)),
                           np.nextafter(pts, np.float32(np.inf))])
    special = np.array([np.inf, -np.inf, np.nan], np.float32)
    return np.concatenate([pats.view(np.float32), near, -near, special])


# -- the libraries' casts: float32 array -> codes (uint8) ------------------------------------


def _torch_cast(dtype_name: str) -> Callable[[np.ndarray], np.ndarray]:
    import torch

    dtype = getattr(torch, dtype_name)

    def cast(x: np.ndarray) -> np.ndarray:
        return torch.from_numpy(x).to(dtype).view(torch.uint8).numpy()

    return cast


def _ml_dtypes_cast(type_name: str, bits: int) -> Callable[[np.ndarray], np.ndarray]:
    import ml_dtypes

    dtype = getattr(ml_dtypes, type_name)

    def cast(x: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore", invalid="ignore"):
            codes = x.astype(dtype)
        view = codes.view(np.uint16 if bits > 8 else np.uint8)
        return view & ((1 << bits) - 1)

    return cast


def _triton_cast(kind: str) -> Callable[[np.ndarray], np.ndarray]:
    import torch

    from fp8sim.kernels.native_cast import native_cast

    device = "cuda" if torch.cuda.is_available() else "cpu"
    fmt = "e5m2" if kind == "e5" else "e4m3"

    def cast(x: np.ndarray) -> np.ndarray:
        xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32).reshape(-1)).to(device)
        return native_cast(xt, fmt).cpu().numpy()

    return cast


def available_casts() -> list[tuple[str, str, str, Callable[[], Callable]]]:
    """(library, its type name, our format, factory) for every cast we know how to call."""
    casts: list = []
    try:
        import torch

        for tname, ours in [("float8_e4m3fn", "e4m3"), ("float8_e5m2", "e5m2"),
                            ("float8_e4m3fnuz", "e4m3fnuz"), ("float8_e5m2fnuz", "e5m2fnuz"),
                            ("float8_e8m0fnu", "e8m0")]:
            if hasattr(torch, tname):
                casts.append(("torch", tname, ours, lambda t=tname: _torch_cast(t)))
    except ImportError:
        pass
    try:
        import ml_dtypes  # noqa: F401

        for tname, ours in [("float8_e4m3fn", "e4m3"), ("float8_e5m2", "e5m2"),
                            ("float8_e4m3fnuz", "e4m3fnuz"), ("float8_e5m2fnuz", "e5m2fnuz"),
                            ("float8_e3m4", "e3m4"), ("float8_e4m3b11fnuz", "e4m3b11fnuz"),
                            ("float6_e2m3fn", "e2m3"), ("float6_e3m2fn", "e3m2"),
                            ("float4_e2m1fn", "e2m1"), ("float8_e8m0fnu", "e8m0"),
                            ("bfloat16", "bf16")]:
            bits = get_format(ours).bits
            casts.append(("ml_dtypes", tname, ours,
                          lambda t=tname, b=bits: _ml_dtypes_cast(t, b)))
    except ImportError:
        pass
    import importlib.util

    if importlib.util.find_spec("triton") is not None:  # imported only by fp8sim.kernels
        import torch

        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        mode = "interpreter" if interpret else "native"
        if interpret or torch.cuda.is_available():
            casts.append((f"triton-{mode}", "tl.float8e4nv", "e4m3", lambda: _triton_cast("e4")))
            casts.append((f"triton-{mode}", "tl.float8e5", "e5m2", lambda: _triton_cast("e5")))
    return casts


def untested_libraries() -> dict[str, str]:
    """Library of :data:`LIBRARIES` -> why its casts cannot be checked here (not installed; for
    Triton also: neither a CUDA GPU nor its interpreter, ``TRITON_INTERPRET=1``)."""
    import importlib.util

    out = {}
    hints = {"torch": "pip install torch", "ml_dtypes": "pip install ml_dtypes",
             "triton": "pip install -e '.[gpu]' from a checkout, or pip install triton"}  # fmt: skip
    for lib in LIBRARIES:
        if importlib.util.find_spec(lib) is None:
            out[lib] = f"{lib} is not installed ({hints[lib]})"
    if "triton" not in out and os.environ.get("TRITON_INTERPRET") != "1":
        import torch

        if not torch.cuda.is_available():
            out["triton"] = "no CUDA GPU, and TRITON_INTERPRET=1 is not set for its interpreter"
    return out


def _agreement(theirs: np.ndarray, ours: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    a = decode(theirs.astype(fmt.code_dtype), fmt, dtype=np.float64)
    b = decode(ours, fmt, dtype=np.float64)
    return (theirs == ours) | (np.isnan(a) & np.isnan(b))


def _check(library: str, tname: str, fmt: FloatFormat, inputs: str, x: np.ndarray,
           cast: Callable[[np.ndarray], np.ndarray], max_examples: int) -> CheckResult:
    if fmt.nan == "none":
        # no NaN/inf codes exist; a library must clamp or fail -- judge the finite range only
        x = x[np.isfinite(x)]
    excluded, note = 0, None
    if (library, tname) in KNOWN_DIFFERENCES:
        note, covered = KNOWN_DIFFERENCES[(library, tname)]
        skip = covered(x)
        excluded = int(skip.sum())
        x = x[~skip]
    theirs = cast(x).astype(np.int64)
    agree = {}
    for sat in (True, False):
        try:
            ours = encode(x, fmt, rounding="rne", saturate=sat)
        except ValueError:  # format without NaN refuses overflow when not saturating
            agree[sat] = None
            continue
        agree[sat] = _agreement(theirs, ours.astype(np.int64), fmt)
    n = x.size
    counts = {s: (-1 if a is None else int(a.sum())) for s, a in agree.items()}
    if counts[True] == n and counts[False] == n:
        verdict = "agrees (no overflow in range)"
    elif counts[True] == n:
        verdict = "agrees, saturating"
    elif counts[False] == n:
        verdict = "agrees, non-saturating"
    else:
        verdict = "DISAGREES"
    best = True if counts[True] >= counts[False] else False
    examples = []
    if verdict == "DISAGREES":
        ours = encode(x, fmt, rounding="rne", saturate=best).astype(np.int64)
        bad = np.flatnonzero(~agree[best])
        # the first few, plus the worst (largest relative error against a nonzero result)
        picks = list(bad[: max(1, max_examples - 1)])
        tv = decode_table(fmt)[theirs[bad]].astype(np.float64)
        ov = decode_table(fmt)[ours[bad]].astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(tv != 0, np.abs(tv - ov) / np.abs(ov), -1.0)
        rel[~np.isfinite(rel)] = -1  # zeros, NaN, inf: no relative error to rank by
        if bad.size and int(bad[int(np.argmax(rel))]) not in picks:
            picks.append(int(bad[int(np.argmax(rel))]))
        for i in picks:
            examples.append({
                "input": float(x[i]),
                "theirs": f"{int(theirs[i]):#04x}",
                "theirs_value": float(decode_table(fmt)[theirs[i]]),
                "emulator": f"{int(ours[i]):#04x}",
                "emulator_value": float(decode_table(fmt)[ours[i]]),
            })
    return CheckResult(library, tname, fmt.name, inputs, n, counts[True], counts[False],
                       verdict, examples, None, excluded, note)


def run_conformance(n_patterns: int = 1 << 20, libraries: list[str] | None = None,
                    max_examples: int = 3, progress: Callable[[str], None] | None = None
                    ) -> list[CheckResult]:
    """Run every available cast over float16-all and a float32 sweep; one result per pair."""
    results = []
    for library, tname, ours, factory in available_casts():
        if libraries and not any(library.startswith(lib) for lib in libraries):
            continue
        fmt = get_format(ours)
        try:
            cast = factory()
        except Exception as exc:  # a library present but unusable: report, do not hide
            results.append(CheckResult(library, tname, ours, "-", 0, 0, 0, "ERROR", [],
                                       f"{type(exc).__name__}: {exc}"))
            continue
        for inputs, x in (("float16-all", float16_all()),
                          ("float32-sweep", float32_sweep(n_patterns, fmt))):
            if progress:
                progress(f"{library} {tname} {inputs}")
            try:
                results.append(_check(library, tname, fmt, inputs, x, cast, max_examples))
            except Exception as exc:
                results.append(CheckResult(library, tname, ours, inputs, x.size, 0, 0,
                                           "ERROR", [], f"{type(exc).__name__}: {exc}"))
    return results

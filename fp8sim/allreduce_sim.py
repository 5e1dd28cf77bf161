"""FP8 gradient all-reduce, simulated in one process: the variants FP8-LM compares.

Every rank ``r`` holds a float32 gradient ``g_r`` of the same tensor. All variants share one
per-tensor multiplier ``k`` on every rank (FP8-LM: the minimum of the ranks' scales, i.e. the
scale of the global amax), encode ``codes_r = encode(float32(g_r) * k)`` (E4M3, round to
nearest even, saturating), add the decoded codes, re-encode the sum, and decode the average as
``decode(sum_codes) / (k * N)``. They differ in ``k`` (``s = fmt.max / max_r amax(g_r)``):

* ``pre``       -- pre-scaling, ``k = s / N``: every rank divides by N first; small values
  underflow (FP8-LM section 2.1);
* ``post``      -- post-scaling, ``k = s``: the sum is divided by N afterwards; large sums
  overflow (saturate at ``fmt.max``);
* ``msamp``     -- MS-AMP's fixed pre-scale, ``k = 2**floor(log2 s) / sqrt(N)`` (msamp/nn/
  distributed.py: power-of-two scaling factor times ``1 / sqrt(world_size)``);
* ``autoscale`` -- FP8-LM's automatic scaling, ``k = mu * s`` with ``mu`` from an
  :class:`fp8sim.policies.AutoScale` policy that observes the share of sums that hit ``fmt.max``
  (halves ``mu`` above 0.001%, regrows it towards 2 otherwise), one state per tensor, step by step.

and in how the sum is formed:

* ``exact`` -- reduce-scatter: decoded codes summed in float32 (exact: E4M3 values are
  multiples of ``2**-9`` below ``2**9``, so up to 64 of them add exactly) and encoded once;
* ``ring``  -- an N-hop ring whose every hop re-rounds the partial sum to FP8, as an all-reduce
  over FP8 buffers does; chunk ``j`` (of N equal chunks) starts at rank ``(j + 1) % N``.

The global amax is what an all-reduce of the ranks' amaxes (``all_reduce(MAX)`` of CUDA float32
tensors) gives: each rank's own amax propagates NaN (``torch.amax``, :func:`fp8sim.scaling.
compute_amax`), and the MAX across ranks skips NaN amaxes like NCCL's float MAX (``fmaxf``): a rank
holding a NaN does not decide ``k``, the global amax is NaN only when every rank's amax is NaN
(then ``scale_from_amax`` gives scale 1). The result does not depend on which rank holds the NaN.

Errors are measured against the float32 average of the unquantized gradients (summed in float64,
rounded once). :func:`fp8sim.analysis.allreduce_replay.replay_allreduce` runs every variant
over the gradients saved in a trace (``fp8sim replay --allreduce N``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np
import torch

from fp8sim.formats import FloatFormat, get_format

__all__ = [
    "METHODS",
    "REDUCTIONS",
    "AllReduceStats",
    "decode_codes",
    "encode_values",
    "sum_codes",
    "ring_sum_codes",
    "simulate_allreduce",
    "error_figures",
    "global_amax",
    "stats_dict",
]

METHODS = ("pre", "post", "msamp", "autoscale")
REDUCTIONS = ("exact", "ring")


@functools.lru_cache(maxsize=None)
def _table(fmt: FloatFormat) -> torch.Tensor:
    from fp8sim.emulator import decode_table

    return torch.from_numpy(decode_table(fmt, np.float32).copy())


def decode_codes(codes: torch.Tensor, fmt: FloatFormat | str) -> torch.Tensor:
    """Exact float32 values of uint8 ``codes`` (table lookup)."""
    fmt = get_format(fmt)
    return _table(fmt).to(codes.device)[codes.long()]


def encode_values(x: torch.Tensor, fmt: FloatFormat | str, backend: Any = None) -> torch.Tensor:
    """``encode(float32(x))``: round to nearest even, saturating, through ``backend`` (default:
    the emulator)."""
    from fp8sim import backends

    be = backends.get("emulator") if backend is None else backend
    return be.quantize(x.to(torch.float32), get_format(fmt), 1.0)[0]


def _at_max(codes: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    mag = codes & (fmt.sign_mask - 1) if fmt.signed else codes
    return mag == fmt.max_code


def _overflows(y: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Where the float32 value ``y`` rounds above ``fmt.max`` (round to nearest even)."""
    from fp8sim.trace import cast_thresholds

    thr = cast_thresholds(fmt, "rne")
    a = y.abs()
    over = a > thr.overflow_at
    if thr.overflow_tie:
        over |= a == thr.overflow_at
    return over


def sum_codes(
    chunks: Sequence[torch.Tensor], fmt: FloatFormat | str, backend: Any = None
) -> tuple[torch.Tensor, int]:
    """One rounding: ``encode(sum_r decode(chunks[r]))``, the float32 sum taken in rank order
    (exact for up to 64 E4M3 terms). Returns the codes and how many sums rounded above
    ``fmt.max`` (saturated)."""
    fmt = get_format(fmt)
    acc = decode_codes(chunks[0], fmt).clone()
    for c in chunks[1:]:
        acc += decode_codes(c, fmt)
    return encode_values(acc, fmt, backend), int(_overflows(acc, fmt).sum())


def ring_sum_codes(
    chunks: Sequence[torch.Tensor], fmt: FloatFormat | str, backend: Any = None
) -> tuple[torch.Tensor, int]:
    """N - 1 roundings: an FP8 ring reduce (chunk ``j`` starts at rank ``(j + 1) % N``).
    Returns the codes and how many elements saturated at some hop."""
    fmt = get_format(fmt)
    n = len(chunks)
    flat = [c.reshape(-1) for c in chunks]
    numel = flat[0].numel()
    out = torch.empty(numel, dtype=torch.uint8, device=flat[0].device)
    hit = torch.zeros(numel, dtype=torch.bool, device=flat[0].device)
    bounds = [numel * j // n for j in range(n + 1)]
    for j in range(n):
        sl = slice(bounds[j], bounds[j + 1])
        order = [(j + 1 + h) % n for h in range(n)]
        acc = flat[order[0]][sl]
        for r in order[1:]:
            partial = decode_codes(acc, fmt) + decode_codes(flat[r][sl], fmt)  # exact in float32
            hit[sl] |= _overflows(partial, fmt)
            acc = encode_values(partial, fmt, backend)
        out[sl] = acc
    return out.view(chunks[0].shape), int(hit.sum())


@dataclass
class AllReduceStats:
    """One all-reduce of one tensor.

    ``overflow_in``: elements (over all ranks) whose ``|g_r * k|`` rounds above ``fmt.max``;
    ``overflow_sum``: result elements that saturated in the sum (any hop, for the ring);
    ``underflow_in``: nonzero inputs encoded to zero; ``nonzero_in``: nonzero inputs;
    ``underflow_out``: elements whose float32 average is nonzero but the result is zero;
    ``rel_error``: ``||avg - ref||_2 / ||ref||_2``; ``snr_db``: ``20 log10(||ref|| / ||avg - ref||)``
    (:func:`error_figures`: no error gives ``(0, inf)``, an error over a zero reference ``(inf,
    -inf)``, and a NaN anywhere -- a NaN gradient, a NaN sum -- ``(nan, nan)``: undefined, never
    an SNR of ``inf`` next to a NaN error);
    ``k``: the multiplier used; ``mu``: AutoScale's factor (1 for the other methods).
    """

    method: str
    reduce: str
    ranks: int
    numel: int
    overflow_in: int
    overflow_sum: int
    underflow_in: int
    nonzero_in: int
    underflow_out: int
    rel_error: float
    snr_db: float
    k: float
    mu: float = 1.0

    @property
    def underflow_share(self) -> float:
        return self.underflow_in / self.nonzero_in if self.nonzero_in else 0.0


def error_figures(err: float, nref: float) -> tuple[float, float]:
    """``(rel_error, snr_db)`` of an error norm ``err`` against a reference norm ``nref``.

    NaN in either gives ``(nan, nan)`` (undefined); ``err == 0`` gives ``(0, inf)``; an error over
    a zero reference, or an infinite error, ``(inf, -inf)``; otherwise ``err / nref`` and
    ``20 log10(nref / err)``. The two figures never disagree (no ``inf`` SNR beside a NaN or
    infinite error)."""
    err, nref = float(err), float(nref)
    if math.isnan(err) or math.isnan(nref) or (math.isinf(err) and math.isinf(nref)):
        return math.nan, math.nan
    if err == 0:
        return 0.0, math.inf
    if nref == 0 or math.isinf(err):
        return math.inf, -math.inf
    if math.isinf(nref):
        return 0.0, math.inf
    return err / nref, 20 * math.log10(nref / err)


def global_amax(grads: Sequence[torch.Tensor]) -> float:
    """The all-reduced amax of per-rank gradients, independent of the ranks' order.

    Each rank's amax is ``max |g_r|`` with NaN propagating (``torch.amax``; 0 for an empty
    tensor); the MAX across ranks skips NaN amaxes, as ``all_reduce(MAX)`` of CUDA float32
    amaxes does (NCCL reduces floats with ``fmaxf``). NaN only when every rank's amax is NaN;
    ``inf`` when some rank holds an inf."""
    local = [float(g.abs().amax()) if g.numel() else 0.0 for g in grads]
    known = [a for a in local if not math.isnan(a)]
    return max(known) if known else math.nan


def _multiplier(method: str, amax: float, n: int, fmt: FloatFormat, policy: Any, name: str) -> tuple[float, float]:
    """(the cast's multiplier, AutoScale's mu) of ``method``, decided by a quantizer: ``pre``
    ``fmax / amax`` divided by N, ``post`` ``fmax / amax``, ``msamp`` its power of two divided by
    sqrt(N), ``autoscale`` ``mu * fmax / amax`` (``policy``'s state)."""
    from fp8sim.quantizer import Quantizer
    from fp8sim.recipes import CastConfig
    from fp8sim.scaling_config import CurrentScalingConfig

    if method not in METHODS:
        raise ValueError(f"unknown all-reduce method {method!r}; valid: {', '.join(METHODS)}")
    if method == "autoscale":
        q = Quantizer(CastConfig(fmt, policy.config), policy=policy)
        return q.scale_for(name, amax), policy.mu(name)
    divisor = {"pre": n, "post": 1, "msamp": math.sqrt(n)}[method]
    q = Quantizer(CastConfig(fmt, CurrentScalingConfig(pow2=method == "msamp")), scale_divisor=divisor)
    return q.scale_for(name, amax), 1.0


def simulate_allreduce(
    grads: Sequence[torch.Tensor],
    *,
    method: str = "autoscale",
    reduce: str = "exact",
    fmt: FloatFormat | str = "e4m3",
    policy: Any = None,
    name: str = "grad",
    backend: Any = None,
) -> tuple[torch.Tensor, AllReduceStats]:
    """Average ``grads`` (one float tensor per rank, same shape) through FP8; returns the float32
    average and its statistics. ``policy``: the AutoScale policy for ``method="autoscale"``
    (default: a fresh ``autoscale``), observed after the sum (its state advances one step)."""
    if reduce not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduce!r}; valid: {', '.join(REDUCTIONS)}")
    if not grads or any(g.shape != grads[0].shape for g in grads):
        raise ValueError("simulate_allreduce: need one gradient per rank, all of the same shape")
    fmt = get_format(fmt)
    n = len(grads)
    gs = [g.detach().to(torch.float32).cpu() for g in grads]
    amax = global_amax(gs)  # order-independent: a NaN rank does not decide k (module docstring)
    if method == "autoscale" and policy is None:
        from fp8sim.policies import parse_policy

        policy = parse_policy("autoscale")
    k, mu = _multiplier(method, amax, n, fmt, policy, name)
    k32 = torch.tensor(k, dtype=torch.float32)
    codes, over_in, under_in, nonzero = [], 0, 0, 0
    for g in gs:
        y = g * k32  # float32 product, rounded once
        c = encode_values(y, fmt, backend)
        over_in += int(_overflows(y, fmt).sum())
        nz = g != 0
        nonzero += int(nz.sum())
        under_in += int((nz & (decode_codes(c, fmt) == 0)).sum())
        codes.append(c)
    if reduce == "exact":
        out, over_sum = sum_codes(codes, fmt, backend)
    else:
        out, over_sum = ring_sum_codes(codes, fmt, backend)
    avg = decode_codes(out, fmt) / (k32 * n)
    ref = (torch.stack([g.double() for g in gs]).sum(0) / n).float()
    rel_error, snr_db = error_figures(float((avg.double() - ref.double()).norm()), float(ref.double().norm()))
    under_out = int(((ref != 0) & (avg == 0)).sum())
    if method == "autoscale":
        policy.observe(name, amax, fmt, numel=out.numel(), n_at_max=int(_at_max(out, fmt).sum()))
    stats = AllReduceStats(
        method=method, reduce=reduce, ranks=n, numel=out.numel(), overflow_in=over_in, overflow_sum=over_sum,
        underflow_in=under_in, nonzero_in=nonzero, underflow_out=under_out,
        rel_error=rel_error, snr_db=snr_db, k=k, mu=mu,
    )
    return avg, stats



def stats_dict(st: AllReduceStats) -> dict:
    """JSON-ready form of :class:`AllReduceStats`."""
    return {**asdict(st), "underflow_share": st.underflow_share}

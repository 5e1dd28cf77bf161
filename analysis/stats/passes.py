"""The numba passes behind :func:`analysis.stats.tensor_stats` (see its module docstring); the
per-block kernels they run are in :mod:`analysis.stats.blocks`.

Pass A (only when a variant needs a just-in-time scale): each granularity's group amaxes and the
format-independent figures (NaN/inf/zero counts, the finite amax, sum x^2, the log2|x|
histogram), which keep the cores busy while the pass streams the data from memory. Pass B: every
variant's cast figures (and the format-independent ones when pass A did not run), block by
block, so each L1-sized block is loaded from memory once and every variant's cast reads it from
L1.

Each pass splits a chunk into parts whose number depends on the chunk's size only (``prange`` over
the parts, taken by the threads in runs as they finish; each part writes only its outputs, summed
in part order, so the figures depend neither on thread timing nor on the thread count), each part
into blocks of ``BLOCK`` elements. Float32 and float64 input give the same figures on the same
values, to the last bit (tested).
"""

from __future__ import annotations

import numba
import numpy as np

from fp8sim.analysis.stats.blocks import BLOCK, N_HIST_COPIES, N_LOG2
from fp8sim.analysis.stats.blocks import cast_figures, pairwise_sum, scan_figures, tile_amax
from fp8sim._numba.jit import PARALLEL_MIN_ELEMENTS, jit_kernel, jit_serial, serial_twin
from fp8sim.trace import EXPONENT_MIN

__all__ = ["pass_a", "pass_b", "part_count"]

def part_count(n: int) -> int:
    """Parts of a chunk of n elements: 64 Ki elements or more each, at most 64, whatever the
    thread count (so the figures, summed part by part in order, do not depend on it). The
    threads take runs of parts as they finish the previous run (``_run``): on a shared machine
    one slow thread then costs its share of the time, not half the pass."""
    return max(1, min(64, n // (1 << 16)))


@jit_serial
def _scan_range(x, s, e, buf, base, sig2, hist, hsub):
    """The format-independent figures of elements [s, e), block by block (``BLOCK`` elements
    from s), added into base (nan, inf, zero, max float32 bits of the finite |x|), sig2 (low,
    high sum of x^2), hist and hsub (see :func:`analysis.stats.blocks._scan_block`)."""
    for b0 in range(s, e, BLOCK):
        b1 = min(e, b0 + BLOCK)
        n1, n2, n3, mb, q, qh = scan_figures(x[b0:b1], buf, hist, hsub)
        base[0] += n1
        base[1] += n2
        base[2] += n3
        base[3] = max(base[3], np.int64(mb))
        sig2[0] += q
        sig2[1] += qh


@jit_serial
def _add_copies(copies, hist):
    """hist[b] += the count of exponent byte b over the copies a part scattered into."""
    for b in range(hist.size):
        t = 0
        for j in range(copies.shape[0]):
            t += np.int64(copies[j, b])
        hist[b] += t


@jit_serial
def _part_a(x, s, e, i0, ncols, gran, local_off, gamax, gnan, base, sig2, hist, hsub):
    """Pass A over elements [s, e) of the chunk: see :func:`pass_a`."""
    copies = np.zeros((N_HIST_COPIES, 256), np.uint32)  # the part's scratch (in L1, no faults)
    _scan_range(x, s, e, np.empty(BLOCK, np.float64), base, sig2, copies, hsub)
    _add_copies(copies, hist)
    if gran.shape[0] == 0:
        return
    i = s
    r = (i0 + i) // ncols
    c = (i0 + i) - r * ncols
    while i < e:
        seg = min(ncols - c, e - i)
        for g in range(gran.shape[0]):
            R = gran[g, 0]
            C = gran[g, 1]
            Gc = gran[g, 2]
            row_base = local_off[g] + (r // R) * Gc - gran[g, 3]  # + t: the tile's local index
            cc = c
            while cc < c + seg:
                t = cc // C
                stop = min((t + 1) * C, c + seg)
                mb, nn = tile_amax(x[i + cc - c : i + stop - c])
                if mb > gamax[row_base + t]:
                    gamax[row_base + t] = mb
                gnan[row_base + t] += nn
                cc = stop
        i += seg
        r += 1
        c = 0


def _run(kernel, x, n_parts, *args):
    """Run a ``prange``-over-parts kernel ``kernel(x, n_parts, ...)`` with dynamic scheduling:
    the threads take runs of consecutive parts, about two runs each, as they finish the previous
    one (a run of one part costs a few microseconds of scheduling and restarts the memory stream;
    a thread slowed down by the host still costs only its share). Below
    ``PARALLEL_MIN_ELEMENTS`` (one part) the kernel's serial twin runs (waking the thread pool
    took 34 us where both passes on 4096 elements took 10.5 us serially). The
    schedule never changes the figures: each part writes its own outputs, summed in part order."""
    if x.size < PARALLEL_MIN_ELEMENTS:
        return _SERIAL_TWINS[kernel](x, n_parts, *args)
    with numba.parallel_chunksize(max(1, n_parts // (2 * numba.get_num_threads()))):
        return kernel(x, n_parts, *args)


@jit_kernel
def _pass_a_kernel(x, n_parts, i0, ncols, gran, local_off, gamax, gnan):
    base, sig2, hist, hsub = _scan_buffers(n_parts)
    per = (x.size + n_parts - 1) // n_parts
    for p in numba.prange(n_parts):
        s = min(x.size, p * per)
        e = min(x.size, s + per)
        _part_a(x, s, e, i0, ncols, gran, local_off, gamax[p], gnan[p], base[p], sig2[p],
                hist[p], hsub[p])  # fmt: skip
    return _scan_totals(base, sig2, hist, hsub)


@jit_serial
def _scan_buffers(n_parts):
    """Per-part outputs of the format-independent figures (base, sig2, hist = counts of each
    float32 exponent byte, hsub)."""
    return (np.zeros((n_parts, 4), np.int64), np.zeros((n_parts, 2), np.float64),
            np.zeros((n_parts, 256), np.int64),
            np.zeros((n_parts, N_LOG2), np.int64))  # fmt: skip


@jit_serial
def _scan_totals(base, sig2, hist, hsub):
    """Sum the per-part format-independent figures, part after part: (tot (4,) = nan, inf, zero,
    float32 bits of the max finite |x|; sig2 (2,); log2 (N_LOG2,) the histogram)."""
    tot = np.zeros(4, np.int64)
    sq = np.zeros(2, np.float64)
    by_byte = np.zeros(256, np.int64)
    log2 = np.zeros(N_LOG2, np.int64)
    for p in range(base.shape[0]):
        for j in range(3):
            tot[j] += base[p, j]
        tot[3] = max(tot[3], base[p, 3])
        sq[0] += sig2[p, 0]
        sq[1] += sig2[p, 1]
        for b in range(256):
            by_byte[b] += hist[p, b]
        for b in range(N_LOG2):
            log2[b] += hsub[p, b]
    n_sub = log2.sum()
    # exponent byte b of a normal float32: floor(log2) = b - 127, bin b - 127 - EXPONENT_MIN
    for b in range(1, 255):
        log2[b - 127 - EXPONENT_MIN] += by_byte[b]
    log2[0] += by_byte[0] - tot[2] - n_sub  # nonzero values whose float32 is 0
    log2[N_LOG2 - 1] += by_byte[255] - tot[0] - tot[1]  # finite values whose float32 is inf
    return tot, sq, log2


def pass_a(x, i0, ncols, gran, local_off, n_local, n_parts):
    """The amaxes of one chunk's tiles for each tiled granularity, and its format-independent
    figures (pass B need not take them then: this pass reads memory at the bandwidth's pace and
    the scan keeps the cores busy meanwhile).

    x: the chunk (float32/float64), flat C-order elements i0 .. i0+x.size of the (M, ncols) view.
    gran[g] = (R, C, Gc, flat grid index of the first group this chunk can touch: see
    stats.figures._group_range); granularity g's local grid starts at
    local_off[g] in a per-part buffer of n_local entries.
    Returns gamax (P, n_local) group amax as float32 bits (NaN skipped, inf counted), gnan (P,
    n_local) NaN counts, and :func:`_scan_totals` of the chunk (its finite amax and inf count
    among them: the tensor scale's amax).
    """
    gamax = np.zeros((n_parts, n_local), np.uint32)
    gnan = np.zeros((n_parts, n_local), np.int64)
    totals = _run(_pass_a_kernel, x, n_parts, i0, ncols, gran, local_off, gamax, gnan)
    return gamax, gnan, totals


@jit_serial
def _kept_squares(xs, lost, out):
    """``out[k] = x^2`` of the finite values of a tile, 0 for NaN/inf and for all of a lost tile
    (the figures leave it out): the same terms, in the same blocks, as the scan's sum of x^2, so
    the two are equal when nothing is lost. A kept value is finite in float32 (a larger float64
    one makes its MX scale NaN), so no square reaches the scan's "high" sum."""
    for k in range(xs.size):
        ax = abs(np.float64(xs[k]))
        out[k] = ax * ax if (not lost) and ax < np.inf else 0.0


@jit_serial
def _part_b(x, s, e, i0, ncols, vint, vflt, scales, sinvs, scan, base, sig2, hist, hsub, counts,
            err2):  # fmt: skip
    """Pass B over elements [s, e) of the chunk: see :func:`pass_b`."""
    buf = np.empty(BLOCK, np.float64)
    kept = np.empty(BLOCK, np.float64)  # x^2 of the values not lost (variants with vint[v, 10])
    copies = np.zeros((N_HIST_COPIES, 256), np.uint32)  # the scan's exponent bytes (if scan)
    nv = vint.shape[0]
    for b0 in range(s, e, BLOCK):
        b1 = min(e, b0 + BLOCK)
        if scan:
            _scan_range(x, b0, b1, buf, base, sig2, copies, hsub)
        for v in range(nv):
            R = vint[v, 0]
            C = vint[v, 1]
            Gc = vint[v, 2]
            shift = np.uint32(vint[v, 4])
            half_m1 = np.uint32((1 << (vint[v, 4] - 1)) - 1)
            keep = ~np.uint32((1 << vint[v, 4]) - 1)
            max_bits = np.uint32(vint[v, 5])
            minnorm_bits = np.uint32(vint[v, 6])
            csub = np.float32(vflt[v, 0])
            whole = vint[v, 8] != 0  # one scale for the whole tensor: no tiles to walk
            fast32 = vint[v, 9] != 0
            track = vint[v, 10] != 0
            j = b0
            r = (i0 + j) // ncols
            c = (i0 + j) - r * ncols
            while j < b1:
                if whole:
                    t = 0
                    n_el = b1 - j
                    row_base = vint[v, 3]
                else:
                    t = c // C
                    n_el = min(min((t + 1) * C, ncols) - c, b1 - j)
                    row_base = vint[v, 3] + (r // R) * Gc - vint[v, 7]
                sc = scales[row_base + t]
                si = sinvs[row_base + t]
                lost = si != si  # NaN MX scale: the whole block is NaN
                if lost:
                    for k in range(j, j + n_el):
                        counts[v, 3] += np.int64(abs(np.float64(x[k])) < np.inf)
                        counts[v, 4] += np.int64(x[k] == 0)
                        buf[k - b0] = 0.0
                if track:
                    _kept_squares(x[j : j + n_el], lost, kept[j - b0 : j - b0 + n_el])
                if not lost:
                    o, u, sb, qh = cast_figures(
                        x[j : j + n_el], sc, si, shift, half_m1, keep, max_bits, minnorm_bits,
                        csub, buf[j - b0 : j - b0 + n_el], fast32,
                    )  # fmt: skip
                    counts[v, 0] += o
                    counts[v, 1] += u
                    counts[v, 2] += sb
                    err2[v, 1] += qh
                j += n_el
                c += n_el
                if c == ncols:
                    c = 0
                    r += 1
            # the block's squared errors, whatever its tiles: one pairwise sum (a column tile of
            # one element per row would otherwise add them one by one)
            err2[v, 0] += pairwise_sum(buf, b1 - b0)
            if track:
                err2[v, 2] += pairwise_sum(kept, b1 - b0)
    if scan:
        _add_copies(copies, hist)


@jit_kernel
def _pass_b_kernel(x, n_parts, i0, ncols, vint, vflt, scales, sinvs, scan):
    nv = vint.shape[0]
    base, sig2, hist, hsub = _scan_buffers(n_parts)
    counts = np.zeros((n_parts, nv, 5), np.int64)
    err2 = np.zeros((n_parts, nv, 3), np.float64)
    per = (x.size + n_parts - 1) // n_parts
    for p in numba.prange(n_parts):
        s = min(x.size, p * per)
        e = min(x.size, s + per)
        _part_b(x, s, e, i0, ncols, vint, vflt, scales, sinvs, scan, base[p], sig2[p], hist[p],
                hsub[p], counts[p], err2[p])  # fmt: skip
    v_counts, v_err2 = _variant_totals(counts, err2)
    return _scan_totals(base, sig2, hist, hsub), v_counts, v_err2


@jit_serial
def _variant_totals(counts, err2):
    """Sum the per-part cast figures, part after part (the sums depend on the part count only)."""
    v_counts = np.zeros(counts.shape[1:], np.int64)
    v_err2 = np.zeros(err2.shape[1:], np.float64)
    for p in range(counts.shape[0]):
        for v in range(counts.shape[1]):
            for j in range(counts.shape[2]):
                v_counts[v, j] += counts[p, v, j]
            for j in range(err2.shape[2]):
                v_err2[v, j] += err2[p, v, j]
    return v_counts, v_err2


def pass_b(x, i0, ncols, vint, vflt, scales, sinvs, n_parts, scan=True):
    """Every variant's figures over one chunk (one read) and, with ``scan``, the
    format-independent figures (when pass A did not take them).

    vint[v] = (R, C, Gc, scale offset, shift = 23 - mantissa bits, float32 bits of fmt.max,
    float32 bits of fmt.min_normal, flat grid index of the chunk's first group
    (stats.figures._group_range), 1 if one scale covers the whole tensor, 1 if float32 blocks
    may take :func:`analysis.stats.blocks._cast_block_f32`, 1 to sum the x^2 of the values not
    lost to a NaN MX scale); vflt[v] = (2**(emin - m + 23), fmt.max, fmt.min_normal). scales / sinvs: each variant's scales of the groups the chunk can touch,
    flat (float32), variant v's from offset vint[v, 3]. Returns, summed over the parts
    (in part order, so the figures depend only on the part count): :func:`_scan_totals` (None
    without ``scan``), counts (V, 5) = overflow, finite values that round to 0 and that round
    below min_normal (both with the zeros: see analysis.stats.blocks._cast_block), lost (NaN MX
    scale), zeros among the lost; err2 (V, 3) = sum (deq - x)^2 as a (low, high) pair (see
    stats.figures._combine) and, for variants with vint[v, 10] (else 0), sum x^2 over the finite
    values not lost (no "high" part: :func:`_kept_squares`).
    """
    totals, counts, err2 = _run(_pass_b_kernel, x, n_parts, i0, ncols, vint, vflt, scales, sinvs,
                                scan)  # fmt: skip
    return (totals if scan else None), counts, err2


# serial twins for small chunks (see fp8sim._numba.jit.PARALLEL_MIN_ELEMENTS)
_SERIAL_TWINS = {k: serial_twin(k) for k in (_pass_a_kernel, _pass_b_kernel)}


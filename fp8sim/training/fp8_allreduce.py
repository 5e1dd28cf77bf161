"""FP8-LM's FP8 gradient all-reduce (a DDP communication hook) and communication accounting.

The FP8 all-reduce (FP8-LM section 2.1) of the FP8 linears' weight gradients, per DDP bucket:

1. one ``all_reduce(MAX)`` of every tensor's amax (the quantizer's amax reduction,
   :func:`fp8sim.quantizer.max_across`: a rank whose amax is 0 or NaN sets no bound, so an
   all-zero gradient on one rank does not force the scale down to 1 for all);
2. the shared scale ``s`` per tensor from the global amax -- ``mu * fmt.max / amax`` with
   AutoScale's ``mu`` (:class:`fp8sim.policies.AutoScale`), or MS-AMP's fixed
   ``2**floor(log2(fmt.max / amax)) / sqrt(N)`` with ``scaling="msamp"``: the paper's global
   minimum of the ranks' scales, since the rule decreases with the amax;
3. every rank encodes ``encode(float32(g) * s)`` (E4M3, nearest even, saturating) to uint8 codes;
4. reduce-scatter as ``all_to_all`` of the uint8 payload (padded to a multiple of N): each rank
   decodes the N copies of its chunk, sums them in float32 (exact: see
   :func:`fp8sim.allreduce_sim.sum_codes`) and re-encodes the sum once;
5. ``all_gather`` of the uint8 chunks; the average gradient is ``decode(codes) * scale_inv`` with
   ``scale_inv = float32(float32(1 / s) / N)``.

AutoScale observes the share of summed codes at ``fmt.max`` (identical on every rank, so the
policies stay in step without communication).

Under FP8-LM O3 the same model runs inside FSDP2's reduce-scatter instead
(:meth:`Fp8GradReducer.reduce_scatter`, called by :class:`fp8sim.training.fsdp_fp8.Fp8ReduceScatter`):
steps 1-4 on each FSDP unit's flat buffer, no step 5 -- every rank keeps the reduced shard it
owns; the counts of sums at ``fmt.max`` then travel in one small ``all_reduce`` (int32 per tensor)
so AutoScale stays identical on every rank. The other gradients are averaged by an
``all_reduce`` in bfloat16 (or float32; under FSDP2 an ``all_to_all`` of bfloat16 values summed in
float32 in rank order). The reduced gradients are kept in :attr:`Fp8GradReducer.stash`
as they were communicated (codes + scale_inv, or bfloat16 values) for the FP8 optimizer.

Bytes are counted per rank with the ring algorithms' volumes (:func:`ring_bytes`).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Iterable, Sequence

import torch

from fp8sim.formats import get_format
from fp8sim.allreduce_sim import decode_codes, sum_codes

__all__ = ["GRAD_SCALINGS", "FP8_GRAD_SCOPES", "COMM_CATEGORIES", "ring_bytes", "CommCounter", "Fp8GradReducer"]

#: how the shared gradient scale is chosen: FP8-LM's AutoScale or MS-AMP's fixed 1/sqrt(N)
GRAD_SCALINGS = ("autoscale", "msamp")
#: which gradients travel in FP8: every parameter's, or only the FP8 linears' weights' (MS-AMP)
FP8_GRAD_SCOPES = ("all", "linear")
#: categories of the bytes a rank sends
COMM_CATEGORIES = ("wgrad_fp8", "scales", "grads_other", "weights")


def ring_bytes(op: str, nbytes: int, world: int) -> int:
    """Bytes one rank sends in a collective over ``world`` ranks on a ring, for a payload of
    ``nbytes`` (the whole tensor): ``all_reduce`` ``2 (N-1)/N B``; ``all_to_all``,
    ``reduce_scatter``, ``all_gather`` and (pipelined, averaged over ranks) ``broadcast``
    ``(N-1)/N B``. Rounded up to whole bytes; 0 for one rank."""
    factor = {"all_reduce": 2, "all_to_all": 1, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1}
    if op not in factor:
        raise ValueError(f"ring_bytes: unknown collective {op!r}; valid: {', '.join(factor)}")
    return -(-factor[op] * (world - 1) * int(nbytes) // world)


class CommCounter:
    """Bytes this rank sends, per category, since the last :meth:`pop`; also what BF16 would
    send for the FP8 payloads (``wgrad_bf16_equiv``)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.counts: Counter = Counter()

    def add(self, category: str, op: str, nbytes: int) -> None:
        self.counts[category] += ring_bytes(op, nbytes, self.world)

    def add_sent(self, category: str, nbytes: int) -> None:
        """Bytes this rank sends point to point (an uneven ``all_to_all``), counted as they are."""
        self.counts[category] += int(nbytes)

    def pop(self) -> dict[str, int]:
        out = {k: int(self.counts.get(k, 0)) for k in (*COMM_CATEGORIES, "wgrad_bf16_equiv")}
        self.counts.clear()
        return out


class Fp8GradReducer:
    """Averages gradients across ranks: FP8 for the FP8 linears' weights, bf16/fp32 for the rest.

    Use as a DDP communication hook (``ddp.register_comm_hook(None, reducer.hook)``) or call
    :meth:`reduce` on ``(parameter, gradient)`` pairs directly (one process: no communication).

    Args:
        named_params: ``(name, parameter)`` of the model (names key the AutoScale states).
        fp8_names: parameters whose gradients travel in FP8.
        world: number of ranks; group: the process group (None: default).
        fmt: gradient format (``e4m3``, FP8-LM's choice).
        scaling: ``"autoscale"`` (or an ``autoscale:...`` spec) or ``"msamp"``.
        other_dtype: dtype of the other gradients' all-reduce (torch.bfloat16 or torch.float32).
        backend: FP8 backend name or object (quantize / amax).
        counter: a :class:`CommCounter` (created if None).
    """

    def __init__(
        self,
        named_params: Iterable[tuple[str, torch.Tensor]],
        fp8_names: set[str],
        *,
        world: int,
        group: Any = None,
        fmt: str = "e4m3",
        scaling: str = "autoscale",
        other_dtype: torch.dtype = torch.bfloat16,
        backend: str | Any = "emulator",
        counter: CommCounter | None = None,
    ) -> None:
        from fp8sim import backends
        from fp8sim.quantizer import Quantizer, max_across
        from fp8sim.recipes import CastConfig
        from fp8sim.scaling_config import CurrentScalingConfig, parse_scaling

        if scaling.split(":")[0] not in GRAD_SCALINGS:
            raise ValueError(f"gradient scaling must be one of {GRAD_SCALINGS}, got {scaling!r}")
        if other_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"other_dtype must be torch.bfloat16 or torch.float32, got {other_dtype}")
        self.names = {id(p): n for n, p in named_params}
        self.fp8_names = set(fp8_names)
        self.world, self.group = world, group
        self.fmt = get_format(fmt)
        self.scaling = scaling
        self.other_dtype = other_dtype
        self.backend = backends.get(backend) if isinstance(backend, str) else backend
        # the shared scale: every rank's amax MAX-reduced (a rank whose amax is 0 or NaN sets no
        # bound), then AutoScale's mu * fmax / amax, or MS-AMP's power-of-two scale / sqrt(N)
        reduction = max_across(group) if world > 1 else None
        if scaling.startswith("autoscale"):
            self.quantizer = Quantizer(CastConfig(self.fmt, parse_scaling(scaling)[0]), self.backend,
                                       amax_reduction=reduction)
        else:
            self.quantizer = Quantizer(CastConfig(self.fmt, CurrentScalingConfig(pow2=True)), self.backend,
                                       amax_reduction=reduction, scale_divisor=math.sqrt(world))
        self.policy = self.quantizer.policy if scaling.startswith("autoscale") else None
        self.counter = counter if counter is not None else CommCounter(world)
        self.stash: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.stats: Counter = Counter()

    # -- DDP hook -------------------------------------------------------------------------------
    def hook(self, state, bucket):  # no annotations: DDP checks them against its own types
        """DDP communication hook: reduce the bucket's gradients in place, return a done future."""
        buf = bucket.buffer()  # the flat concatenation of the bucket's gradients, in order
        outs = self.reduce(list(zip(bucket.parameters(), bucket.gradients())))
        buf.copy_(torch.cat([o.reshape(-1) for o in outs]).to(buf.dtype))
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(buf)
        return fut

    def reduce(self, items: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Average the gradients of ``(parameter, gradient)`` pairs over ranks; float32 results
        in the same order. Every rank must call it with the same parameters in the same order."""
        fp8 = [i for i, (p, _) in enumerate(items) if self.names.get(id(p)) in self.fp8_names]
        fp8_set = set(fp8)
        other = [i for i in range(len(items)) if i not in fp8_set]
        out: list[torch.Tensor | None] = [None] * len(items)
        if fp8:
            for i, r in zip(fp8, self._reduce_fp8([items[i] for i in fp8])):
                out[i] = r
        if other:
            for i, r in zip(other, self._reduce_other([items[i] for i in other])):
                out[i] = r
        return out  # type: ignore[return-value]

    def grad_for(self, p: torch.Tensor) -> tuple[torch.Tensor, float] | None:
        """The reduced gradient of ``p`` as the optimizer consumes it: ``(values, scale_inv)``
        (decoded codes and their scale_inv, or the bf16/fp32 average and 1)."""
        got = self.stash.get(id(p))
        if got is None:
            return None
        t, sinv = got
        if sinv is None:
            return t, 1.0
        return decode_codes(t, self.fmt), float(sinv)

    def stash_bytes(self, p: torch.Tensor) -> int:
        """Bytes of ``p``'s stored reduced gradient (codes + 4-byte scale_inv, or the values)."""
        t, sinv = self.stash[id(p)]
        return t.numel() * t.element_size() + (4 if sinv is not None else 0)

    # -- FP8 path -------------------------------------------------------------------------------
    def _shared_scales(self, names: list[str], grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 1-2: every tensor's amax MAX-reduced over the ranks (one all_reduce) and its
        shared scale (float32)."""
        amaxes = self.quantizer.reduce_amax(torch.stack([self.backend.amax(g) for g in grads]))
        scales = torch.tensor([self.quantizer.scale_for(nm, float(a)) for nm, a in zip(names, amaxes)],
                              dtype=torch.float32)
        self.counter.add("scales", "all_reduce", scales.numel() * 4)
        return amaxes, scales

    def _encode(self, name: str, g: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """Step 3: ``encode(float32(g) * s)`` (counting the values that underflow to zero)."""
        c = self.quantizer.quantize(name, g, observe=False, scale=s).codes
        nz = g != 0
        self.stats["underflow"] += int((nz & ((c & (self.fmt.sign_mask - 1)) == 0)).sum())
        self.stats["nonzero"] += int(nz.sum())
        return c

    def _at_max(self, c: torch.Tensor) -> int:
        return int(((c & (self.fmt.sign_mask - 1)) == self.fmt.max_code).sum())

    def _reduce_fp8(self, items: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        import torch.distributed as dist

        n, fmt = self.world, self.fmt
        names = [self.names[id(p)] for p, _ in items]
        grads = [g.detach().to(torch.float32) for _, g in items]
        amaxes, scales = self._shared_scales(names, grads)
        flat = torch.cat([self._encode(nm, g, s).reshape(-1) for nm, g, s in zip(names, grads, scales)])
        numel = flat.numel()
        pad = (-numel) % n
        if pad:
            flat = torch.cat([flat, torch.zeros(pad, dtype=torch.uint8, device=flat.device)])
        if n > 1:
            mine = torch.empty_like(flat)
            dist.all_to_all_single(mine, flat, group=self.group)  # chunk r of every rank -> rank r
            summed, over = sum_codes(list(mine.chunk(n)), fmt, self.backend)
            full = torch.empty_like(flat)
            dist.all_gather(list(full.chunk(n)), summed, group=self.group)
        else:
            full, over = sum_codes([flat], fmt, self.backend)
        self.stats["overflow"] += over  # of this rank's chunk
        self.counter.add("wgrad_fp8", "all_to_all", flat.numel())
        self.counter.add("wgrad_fp8", "all_gather", flat.numel())
        self.counter.add("wgrad_bf16_equiv", "all_reduce", 2 * numel)
        out, off = [], 0
        for (p, g), nm, s, a in zip(items, names, scales, amaxes.tolist()):
            c = full[off : off + g.numel()].view(g.shape)
            off += g.numel()
            sinv = (torch.reciprocal(s) / n).to(torch.float32)
            self.stash[id(p)] = (c, sinv)
            out.append(decode_codes(c, fmt) * sinv)
            if self.policy is not None:
                self.quantizer.observe(nm, a, numel=c.numel(), n_at_max=self._at_max(c))
        return out

    def reduce_scatter(self, pieces: Sequence[tuple], output: torch.Tensor) -> None:
        """FSDP2's reduce-scatter of one unit (see the module docstring): ``pieces`` are
        ``(name, sharded parameter, segments, padded shard size, full size)`` with ``segments``
        the (N, k) float32 view of the tensor's N padded shards in the flat input; ``output``
        (this rank's flat shard, k per tensor in the same order) receives the averages. The
        reduced shards go into :attr:`stash` (codes + scale_inv, or bfloat16 values)."""
        import torch.distributed as dist

        n, fmt = self.world, self.fmt
        offsets, off = {}, 0
        for nm, _, seg, _, _ in pieces:
            offsets[nm] = off
            off += seg.shape[1]
        fp8 = [pc for pc in pieces if pc[0] in self.fp8_names]
        other = [pc for pc in pieces if pc[0] not in self.fp8_names]
        if fp8:
            names = [pc[0] for pc in fp8]
            amaxes, scales = self._shared_scales(names, [pc[2] for pc in fp8])
            codes = torch.cat([self._encode(nm, seg, s) for (nm, _, seg, _, _), s in zip(fp8, scales)], dim=1)
            recv = torch.empty_like(codes)  # (N, K): row r is rank r's copy of this rank's shard
            dist.all_to_all_single(recv, codes, group=self.group)
            self.counter.add("wgrad_fp8", "all_to_all", codes.numel())
            self.counter.add("wgrad_bf16_equiv", "reduce_scatter", 2 * codes.numel())
            summed, over = sum_codes(list(recv), fmt, self.backend)
            self.stats["overflow"] += over
            at_max = torch.zeros(len(fp8), dtype=torch.int32, device=codes.device)
            k0 = 0
            for i, ((nm, p, seg, padded, _), s) in enumerate(zip(fp8, scales)):
                c = summed[k0 : k0 + seg.shape[1]]
                k0 += seg.shape[1]
                sinv = (torch.reciprocal(s) / n).to(torch.float32)
                output[offsets[nm] : offsets[nm] + c.numel()].copy_(decode_codes(c, fmt) * sinv.to(c.device))
                self.stash[id(p)] = (c.view(padded)[: _local_rows(p)], sinv)
                at_max[i] = self._at_max(c)
            if self.policy is not None:
                dist.all_reduce(at_max, group=self.group)  # every rank's AutoScale sees every shard's count
                self.counter.add("scales", "all_reduce", at_max.numel() * 4)
                for i, (nm, _, _, _, full) in enumerate(fp8):
                    self.quantizer.observe(nm, float(amaxes[i]), numel=math.prod(full), n_at_max=int(at_max[i]))
        if other:
            vals = torch.cat([seg.to(self.other_dtype) for _, _, seg, _, _ in other], dim=1)
            recv = torch.empty_like(vals)
            dist.all_to_all_single(recv, vals, group=self.group)
            self.counter.add("grads_other", "all_to_all", vals.numel() * vals.element_size())
            acc = recv[0].float()
            for r in range(1, n):
                acc += recv[r].float()  # in rank order
            avg = (acc.to(self.other_dtype).float() / n).to(self.other_dtype)
            k0 = 0
            for nm, p, seg, padded, _ in other:
                v = avg[k0 : k0 + seg.shape[1]]
                k0 += seg.shape[1]
                output[offsets[nm] : offsets[nm] + v.numel()].copy_(v.float())
                self.stash[id(p)] = (v.view(padded)[: _local_rows(p)], None)

    # -- the other gradients --------------------------------------------------------------------
    def _reduce_other(self, items: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        import torch.distributed as dist

        flat = torch.cat([g.detach().reshape(-1).to(self.other_dtype) for _, g in items])
        if self.world > 1:
            dist.all_reduce(flat, group=self.group)
        self.counter.add("grads_other", "all_reduce", flat.numel() * flat.element_size())
        avg = (flat.float() / self.world).to(self.other_dtype)  # exact for a power-of-two N
        out, off = [], 0
        for p, g in items:
            v = avg[off : off + g.numel()].view(g.shape)
            off += g.numel()
            self.stash[id(p)] = (v, None)
            out.append(v.float())
        return out

    def state_dict(self) -> dict:
        """AutoScale's per-tensor state (identical on every rank), for checkpoints."""
        return {"scaling": self.scaling, "policy": self.policy.state_dict() if self.policy is not None else None}

    def load_state_dict(self, d: dict) -> None:
        if d.get("scaling") != self.scaling:
            raise ValueError(f"gradient reducer state is for scaling {d.get('scaling')!r}, this run uses {self.scaling!r}")
        if self.policy is not None:
            self.policy.load_state_dict(d["policy"])

    def mu_range(self) -> tuple[float, float] | None:
        """Smallest and largest AutoScale mu over the tensors seen (None for MS-AMP scaling)."""
        if self.policy is None:
            return None
        mus = [self.policy.mu(n) for n in sorted(self.fp8_names)]
        return (min(mus), max(mus)) if mus else None

    def pop_stats(self) -> dict[str, int]:
        out = {k: int(self.stats.get(k, 0)) for k in ("overflow", "underflow", "nonzero")}
        self.stats.clear()
        return out


def _local_rows(p: torch.Tensor) -> int:
    """Rows of a sharded parameter's local shard (FSDP2 shards dim 0)."""
    from fp8sim.training.fsdp_fp8 import local_data

    return local_data(p).shape[0]

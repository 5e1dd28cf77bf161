"""ZeRO-style sharding for FP8-LM O3: whole tensors per rank, FP8 weights gathered with their scales.

FP8-LM (arXiv:2310.18313, section 2.3, Algorithm 1) does not split tensors into equal flat
slices as ZeRO does, because a slice of an FP8 tensor would need its own scale. Whole tensors are
placed instead: largest first, each on the rank with the least memory assigned so far
(:func:`place_tensors`; ties broken by tensor index and then by the lowest rank, as MS-AMP's
``FP8DeepSpeedZeroOptimizer`` does).

:class:`ZeroFp8Weights` runs the O3 step: the owner of a tensor receives its reduced gradient
(the FP8 gradient reducer sends each tensor to its owner only, see
:mod:`fp8sim.training.fp8_allreduce`), keeps its FP16 master and its Adam states (an :class:`~fp8sim.training.optim.Fp8AdamW` over the owned tensors only) and updates
it; then every owner broadcasts its new weights in one buffer -- E4M3 codes for the FP8 linears'
weights, FP16 master values for the others -- together with their ``scale_inv`` (one float32
each). Every rank stores the FP8 weights as codes between steps and decodes them into the
model's float32 parameter (the working copy the forward pass casts; the cast of an E4M3 tensor
with a power-of-two scale is lossless).

Weight scale: ``2**floor(log2(448 / amax))`` of the master (MS-AMP's rule for weights: power of
two, window 1), so the stored weight never saturates.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from fp8sim.formats import get_format
from fp8sim.quantizer import Quantizer
from fp8sim.recipes import CastConfig
from fp8sim.scaling_config import CurrentScalingConfig

__all__ = ["place_tensors", "ZeroFp8Weights"]


def place_tensors(sizes: Sequence[int], ranks: int) -> list[int]:
    """FP8-LM Algorithm 1: the owner rank of each tensor (whole tensors, greedy by size).

    Tensors are visited largest first (equal sizes in index order) and each goes to the rank
    whose assigned element count is smallest (the lowest such rank). The largest load is then at
    most ``(4/3 - 1/(3 N))`` times the best possible (Graham's bound for this greedy rule).
    """
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"place_tensors: ranks must be an int >= 1, got {ranks!r}")
    if any(int(s) < 0 for s in sizes):
        raise ValueError("place_tensors: tensor sizes must be >= 0")
    load = [0] * ranks
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-int(sizes[i]), i)):
        r = load.index(min(load))
        owner[i] = r
        load[r] += int(sizes[i])
    return owner


class ZeroFp8Weights:
    """O3 weights and optimizer: sharded masters/states, FP8 weights gathered with their scales.

    Args:
        named_params: ``(name, parameter)`` of the whole model, the same order on every rank.
        fp8_names: names of the parameters stored as E4M3 (the FP8 linears' weights).
        rank, world: this process and the group size.
        group: the process group (None: the default group); unused when ``world == 1``.
        optimizer_kwargs: for :class:`~fp8sim.training.optim.Fp8AdamW` (lr, betas, eps,
            weight_decay, backend, grad_source).
        count_bytes: ``count_bytes(category, op, nbytes)`` for the communication metrics.
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.nn.Parameter]],
        fp8_names: set[str],
        *,
        rank: int,
        world: int,
        group: Any = None,
        optimizer_kwargs: dict | None = None,
        count_bytes: Callable[[str, str, int], None] | None = None,
        weight_fmt: str = "e4m3",
    ) -> None:
        from fp8sim import backends
        from fp8sim.training.optim import Fp8AdamW

        kw = dict(optimizer_kwargs or {})
        self.params = list(named_params)
        self.fp8_names = set(fp8_names)
        self.rank, self.world, self.group = rank, world, group
        self.fmt = get_format(weight_fmt)
        be = kw.get("backend", "emulator")
        self.backend = backends.get(be) if isinstance(be, str) else be
        self._weights = Quantizer(CastConfig(self.fmt, CurrentScalingConfig(pow2=True)), self.backend)
        self.owner = place_tensors([p.numel() for _, p in self.params], world)
        owned = [p for (_, p), o in zip(self.params, self.owner) if o == rank]
        # a rank that owns nothing still needs an optimizer object (param_groups for the lr)
        self.optimizer = Fp8AdamW(owned if owned else [torch.nn.Parameter(torch.zeros(0))], **kw)
        self._empty = not owned
        self.count_bytes = count_bytes or (lambda *a: None)
        self.codes: dict[str, torch.Tensor] = {}
        self.scale_inv: dict[str, torch.Tensor] = {}
        self.gather()  # the owners' FP16-master values replace every rank's initial weights

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def loads(self) -> list[int]:
        """Elements owned by each rank."""
        load = [0] * self.world
        for (_, p), o in zip(self.params, self.owner):
            load[o] += p.numel()
        return load

    # -- the step -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, *, grad_scale: float = 1.0) -> None:
        """Update the owned tensors (FP8-LM Adam), then gather every weight on every rank."""
        if not self._empty:
            self.optimizer.step(grad_scale=grad_scale)
        self.gather()

    def _weight_payload(self, name: str, p: torch.nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
        """What the owner sends for one tensor: (uint8 bytes, float32 scale_inv)."""
        st = self.optimizer.state[p]
        if name in self.fp8_names:
            w = st["master"].float() * st["master_scale_inv"]  # exact: power-of-two scale
            q = self._weights.quantize(name, w, observe=False)  # power-of-two scale from its amax
            return q.codes.reshape(-1), q.scale_inv.reshape(1).float()
        return st["master"].reshape(-1).view(torch.uint8), st["master_scale_inv"].reshape(1).float()

    def _nbytes(self, name: str, p: torch.nn.Parameter) -> int:
        return p.numel() * (1 if name in self.fp8_names else 2)

    @torch.no_grad()
    def gather(self) -> None:
        """Owners broadcast weights (+ scale_inv); every rank stores FP8 codes and refreshes the
        model's float32 parameters."""
        import torch.distributed as dist

        for src in range(self.world):
            mine = [(n, p) for (n, p), o in zip(self.params, self.owner) if o == src]
            if not mine:
                continue
            sizes = [self._nbytes(n, p) for n, p in mine]
            if src == self.rank:
                parts = [self._weight_payload(n, p) for n, p in mine]
                data = torch.cat([b for b, _ in parts]) if parts else torch.zeros(0, dtype=torch.uint8)
                sinv = torch.cat([s for _, s in parts])
            else:
                data = torch.empty(sum(sizes), dtype=torch.uint8)
                sinv = torch.empty(len(mine), dtype=torch.float32)
            if self.world > 1:
                dist.broadcast(data, src, group=self.group)
                dist.broadcast(sinv, src, group=self.group)
                self.count_bytes("weights", "broadcast", data.numel())
                self.count_bytes("scales", "broadcast", sinv.numel() * 4)
            off = 0
            for i, ((n, p), size) in enumerate(zip(mine, sizes)):
                chunk = data[off : off + size]
                off += size
                s = sinv[i].clone()
                if n in self.fp8_names:
                    codes = chunk.clone().view(p.shape)
                    self.codes[n], self.scale_inv[n] = codes, s
                    p.copy_(self.backend.dequantize(codes, self.fmt, s))
                else:
                    p.copy_(chunk.view(torch.float16).view(p.shape).float() * s)

    # -- accounting -------------------------------------------------------------------------------
    def weight_bytes(self) -> int:
        """Bytes of the weights every rank stores: E4M3 codes + scale_inv of the FP8 weights, the
        float32 parameters of the others."""
        n = 0
        for name, p in self.params:
            if name in self.fp8_names:
                n += self.codes[name].numel() + 4
            else:
                n += p.numel() * p.element_size()
        return n

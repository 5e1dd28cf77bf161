"""FP8-LM AdamW with precision decoupling (arXiv:2310.18313, section 2.2), through a backend.

Per parameter the optimizer keeps (FP8-LM's O2 level):

* ``master``       float16, holding ``w * master_scale``  -- the master weight, FP16 with a scale;
* ``exp_avg``      uint8 E4M3 codes of ``m * exp_avg_scale`` -- first moment in FP8 with a scale;
* ``exp_avg_sq``   float16, holding ``v * exp_avg_sq_scale`` -- second moment in FP16 (scaled:
  ``g**2`` of small gradients would otherwise underflow FP16);
* the three decode factors ``*_scale_inv`` (0-d float32) and the amaxes of the unscaled float32
  values written by the last step.

One step is one call of the backend's fused ``adam_step`` (:meth:`fp8sim.backends.base.Backend.adam_step`:
float32 arithmetic, decoupled weight decay, every state re-encoded with round-to-nearest-even,
saturating). The emulator backend runs it on the CPU, the triton backend as one GPU kernel.

Choosing the new scales before the fused step writes the state: each is a power of two,
``2**floor(log2(fmt.max / bound))``, from an upper bound of the new value's amax that needs no
extra pass over the tensor:

* ``|m_new| <= beta1 * |m_old| + (1 - beta1) * |g|`` (``|m_old|``: last step's amax, plus the
  E4M3 rounding of the stored value, ``2**-4`` relative);
* ``|v_new| <= beta2 * |v_old| + (1 - beta2) * |g|**2``;
* ``|w_new| <= |w_old| * (1 - lr * wd) + lr * U_t`` with ``U_t`` Adam's bound on
  ``|m_hat| / sqrt(v_hat)`` (Cauchy-Schwarz over the exponential sums, finite when
  ``beta1**2 < beta2``), doubled for the rounding of the stored moments.

So no state ever saturates, and a power-of-two scale makes re-encoding an unchanged value exact.
After the step the model's parameter is set to the decoded master, ``float32(master) *
master_scale_inv``; at construction the parameter is replaced by its own FP16 master's value so
both agree from the start.

Sharded parameters (DTensors: FSDP2, tensor parallelism): the step runs on each rank's local
shard, and every amax it decides a scale from (the parameter's, the gradient's, the new states')
is MAX-reduced over the parameter's device mesh first, so the scales -- and, elementwise, every
value -- are those of one process updating the whole tensor. The tensor states are DTensors of
the parameter's placements (``torch.distributed.checkpoint`` reshards them), the per-tensor
scalars plain tensors identical on every rank. Stochastic rounding of sharded states is refused
(its Philox counters are flat indices of the whole tensor).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import numpy as np
import torch

from fp8sim.formats import FloatFormat, get_format
from fp8sim.training.tensor_parallel import is_dtensor

__all__ = ["Fp8AdamW", "update_bound", "GradSource"]

#: ``grad_source(param) -> (grad tensor, grad_scale_inv)`` or None (no gradient this step)
GradSource = Callable[[torch.Tensor], "tuple[torch.Tensor, float] | None"]

_SCALE_EXP_LIMIT = 100  # scales stay in [2**-100, 2**100]: scale_inv is a normal float32


def update_bound(step: int, beta1: float, beta2: float) -> float:
    """Upper bound of Adam's ``|m_hat_t| / sqrt(v_hat_t)`` at 1-based ``step``, exact arithmetic.

    With ``gamma = beta1**2 / beta2 < 1``, Cauchy-Schwarz on ``m_t = (1-b1) sum b1**k g_{t-k}``
    against ``v_t = (1-b2) sum b2**k g_{t-k}**2`` gives
    ``(1-b1)/(1-b1**t) * sqrt((1-gamma**t)/(1-gamma)) * sqrt((1-b2**t)/(1-b2))``.
    """
    gamma = beta1**2 / beta2
    if not gamma < 1:
        raise ValueError(f"Fp8AdamW needs beta1**2 < beta2 (bounds the update), got {beta1}, {beta2}")
    t = step
    return (1 - beta1) / (1 - beta1**t) * math.sqrt((1 - gamma**t) / (1 - gamma)) * math.sqrt(
        (1 - beta2**t) / (1 - beta2)
    )


_FP16 = get_format("fp16")


def _pow2_quantizer(fmt: FloatFormat) -> Any:
    """The decider of the state scales: current scaling, power of two (a bound as the amax)."""
    from fp8sim.quantizer import Quantizer
    from fp8sim.recipes import CastConfig
    from fp8sim.scaling_config import CurrentScalingConfig

    return Quantizer(CastConfig(fmt, CurrentScalingConfig(pow2=True)))


def _pow2_scale(bound: float, fmt: FloatFormat, previous: float) -> float:
    """``2**floor(log2(fmt.max / bound))`` clamped to ``2**+-100``; ``previous`` for bound 0."""
    if not (math.isfinite(bound) and bound > 0):
        return previous
    s = _pow2_quantizer(fmt).scale_for("bound", float(np.float32(bound)))
    e = int(np.frexp(s)[1]) - 1
    return 2.0 ** min(max(e, -_SCALE_EXP_LIMIT), _SCALE_EXP_LIMIT)


class Fp8AdamW(torch.optim.Optimizer):
    """AdamW whose state is FP16 master weights, E4M3 first moments and FP16 second moments.

    Args:
        params: parameters (or parameter groups) as for ``torch.optim.AdamW``; float32 tensors.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled weight decay).
        backend: backend name or object whose ``adam_step`` runs the fused update.
        exp_avg_fmt: format of the first moment (``e4m3``; any 8-bit format).
        rounding: rounding of the three re-encodings (``rne``; ``stochastic`` keys Philox with
            ``seed`` mixed with the step and parameter index).
        seed: for stochastic rounding.
        grad_source: where gradients come from; default ``(p.grad, 1.0)``. The FP8 all-reduce
            hands over decoded E4M3 codes with their scale_inv, which the step consumes as is.

    ``step(grad_scale=c)`` multiplies every gradient by ``c`` (gradient clipping) through
    ``grad_scale_inv``, never by rewriting the gradient tensors.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        backend: str | Any = "emulator",
        exp_avg_fmt: str = "e4m3",
        rounding: str = "rne",
        seed: int | None = None,
        grad_source: GradSource | None = None,
    ) -> None:
        from fp8sim import backends

        update_bound(1, betas[0], betas[1])  # validates beta1**2 < beta2
        if not 0.0 <= lr or not 0.0 < eps or not 0.0 <= weight_decay:
            raise ValueError(f"Fp8AdamW: need lr >= 0, eps > 0, weight_decay >= 0; got {lr}, {eps}, {weight_decay}")
        fmt = get_format(exp_avg_fmt)
        if fmt.bits > 8:
            raise ValueError(f"Fp8AdamW: exp_avg_fmt must be an 8-bit format, got {fmt.name}")
        if rounding == "stochastic" and seed is None:
            raise ValueError("Fp8AdamW: rounding='stochastic' needs seed=")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.backend = backends.get(backend) if isinstance(backend, str) else backend
        self.exp_avg_fmt = fmt
        self.rounding = rounding
        self.seed = seed
        self.grad_source = grad_source
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(p)

    # -- state --------------------------------------------------------------------------------
    @torch.no_grad()
    def _init_state(self, p: torch.Tensor) -> None:
        from fp8sim.training.fsdp_fp8 import local_data

        if p.dtype != torch.float32:
            raise TypeError(f"Fp8AdamW: parameters must be float32, got {p.dtype}")
        if self.rounding == "stochastic" and is_dtensor(p):
            raise NotImplementedError("Fp8AdamW: stochastic rounding of sharded (DTensor) parameters is not "
                                      "implemented; use rounding='rne'")
        w = local_data(p)
        dev = w.device
        amax = _global_max([w.abs().amax() if w.numel() else w.new_zeros(())], [p])[0]
        scale = _pow2_scale(2.0 * amax, _FP16, 1.0)  # one binade of headroom
        master = (w * scale).to(torch.float16)  # float32 product is exact (pow2), RNE
        sinv = torch.tensor(1.0 / scale, dtype=torch.float32, device=dev)
        w.copy_(master.float() * sinv)  # the model starts from its master's value
        scalar = lambda v: torch.tensor(v, dtype=torch.float32, device=dev)  # noqa: E731
        self.state[p] = {
            "step": 0,
            "master": _like(p, master),
            "master_scale_inv": sinv,
            "exp_avg": _like(p, torch.zeros(w.shape, dtype=torch.uint8, device=dev)),
            "exp_avg_scale_inv": scalar(1.0),
            "exp_avg_sq": _like(p, torch.zeros(w.shape, dtype=torch.float16, device=dev)),
            "exp_avg_sq_scale_inv": scalar(1.0),
            "w_amax": scalar(amax),
            "m_amax": scalar(0.0),
            "v_amax": scalar(0.0),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a :meth:`state_dict`, keeping every state tensor's stored dtype (torch's loader
        would turn the float16 masters and second moments into the parameters' float32)."""
        import itertools

        ids = list(itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        dtypes = {pid: {k: v.dtype for k, v in state_dict["state"].get(pid, {}).items() if torch.is_tensor(v)}
                  for pid in ids}
        super().load_state_dict(state_dict)
        params = list(itertools.chain.from_iterable(g["params"] for g in self.param_groups))
        for pid, p in zip(ids, params):
            st = self.state.get(p, {})
            for k, dt in dtypes[pid].items():
                if st[k].dtype != dt:
                    st[k] = st[k].to(dt)  # float16 -> float32 -> float16 is exact

    def master_value(self, p: torch.Tensor) -> torch.Tensor:
        """The master weight of ``p`` decoded to float32 (a sharded parameter's: this rank's shard)."""
        st = self.state[p]
        return _local(st["master"]).float() * st["master_scale_inv"]

    def moments(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(m, v)`` of ``p`` decoded to float32 (a sharded parameter's: this rank's shard)."""
        st = self.state[p]
        m = self.backend.dequantize(_local(st["exp_avg"]), self.exp_avg_fmt, st["exp_avg_scale_inv"])
        v = _local(st["exp_avg_sq"]).float() * st["exp_avg_sq_scale_inv"]
        return m, v

    def state_bytes(self) -> dict[str, int]:
        """Bytes of the live state tensors: ``master``, ``exp_avg``, ``exp_avg_sq`` and the 0-d
        ``scales`` (decode factors and amaxes)."""
        out = {"master": 0, "exp_avg": 0, "exp_avg_sq": 0, "scales": 0}
        for st in self.state.values():
            for key, t in st.items():
                if not torch.is_tensor(t):
                    continue
                n = _local(t).numel() * t.element_size()
                out[key if key in out else "scales"] += n
        return out

    # -- the step -----------------------------------------------------------------------------
    def _grad(self, p: torch.Tensor) -> tuple[torch.Tensor, float] | None:
        if self.grad_source is not None:
            return self.grad_source(p)
        return None if p.grad is None else (p.grad, 1.0)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, grad_scale: float = 1.0) -> Any:
        """One FP8-LM AdamW step for every parameter with a gradient; returns ``closure()``."""
        from fp8sim.training.fsdp_fp8 import local_data

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []  # (index, group, p, local grad, grad_sinv)
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                got = self._grad(p)
                if got is None:
                    continue
                grad, grad_sinv = got
                work.append((index, group, p, _local(grad), float(np.float32(float(grad_sinv) * float(grad_scale)))))
        g_amaxes = _global_max([self.backend.amax(g) for _, _, _, g, _ in work], [p for _, _, p, _, _ in work])
        results = []
        for (index, group, p, grad, grad_sinv), g_amax in zip(work, g_amaxes):
            beta1, beta2 = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            st = self.state[p]
            st["step"] += 1
            t = st["step"]
            g_amax = g_amax * abs(grad_sinv)
            m_bound = beta1 * float(st["m_amax"]) * (1 + 2.0**-3) + (1 - beta1) * g_amax
            v_bound = beta2 * float(st["v_amax"]) + (1 - beta2) * g_amax * g_amax
            w_bound = float(st["w_amax"]) * abs(1 - lr * wd) + 2.0 * lr * update_bound(t, beta1, beta2)
            w_scale = _pow2_scale(w_bound * (1 + 2.0**-8), _FP16, 1.0 / float(st["master_scale_inv"]))
            m_scale = _pow2_scale(m_bound * (1 + 2.0**-8), self.exp_avg_fmt, 1.0 / float(st["exp_avg_scale_inv"]))
            v_scale = _pow2_scale(v_bound * (1 + 2.0**-8), _FP16, 1.0 / float(st["exp_avg_sq_scale_inv"]))
            seed = None
            if self.rounding == "stochastic":
                seed = (self.seed * 0x9E3779B1 + t * 0x85EBCA77 + 3 * index) % 2**62
            master = _local(st["master"])
            res = self.backend.adam_step(
                master, st["master_scale_inv"], grad, _local(st["exp_avg"]), st["exp_avg_scale_inv"],
                _local(st["exp_avg_sq"]), st["exp_avg_sq_scale_inv"], step=t, lr=lr, beta1=beta1, beta2=beta2,
                eps=eps, weight_decay=wd, grad_scale_inv=grad_sinv, param_scale=w_scale,
                exp_avg_scale=m_scale, exp_avg_sq_scale=v_scale, exp_avg_fmt=self.exp_avg_fmt,
                rounding=self.rounding, seed=seed,
            )
            dev = master.device
            st["master_scale_inv"] = res.param_scale_inv.to(dev)
            st["exp_avg_scale_inv"] = res.exp_avg_scale_inv.to(dev)
            st["exp_avg_sq_scale_inv"] = res.exp_avg_sq_scale_inv.to(dev)
            local_data(p).copy_(master.float() * st["master_scale_inv"])
            results.append((p, st, res))
        amaxes = _global_max([a for _, _, r in results for a in (r.param_amax, r.exp_avg_amax, r.exp_avg_sq_amax)],
                             [p for p, _, _ in results for _ in range(3)])
        for i, (_, st, _) in enumerate(results):
            dev = st["master_scale_inv"].device
            st["w_amax"], st["m_amax"], st["v_amax"] = (torch.tensor(a, dtype=torch.float32, device=dev)
                                                         for a in amaxes[3 * i : 3 * i + 3])
        return loss


def _local(t: torch.Tensor) -> torch.Tensor:
    """A state or gradient tensor's local data (a DTensor's shard)."""
    from fp8sim.training.fsdp_fp8 import local_data

    return local_data(t)


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a state tensor of ``p``: a DTensor with ``p``'s mesh and placements when ``p``
    is sharded (so checkpoints reshard it), else ``local`` itself."""
    if not is_dtensor(p):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _global_max(amaxes: list[torch.Tensor], params: list[torch.Tensor]) -> list[float]:
    """Each amax as a float, MAX-reduced (NaN-aware, :func:`fp8sim.quantizer.max_across`) over
    every dimension of its parameter's device mesh when the parameter is a DTensor: one
    ``all_reduce`` per mesh dimension for all of them."""
    out = [float(a) for a in amaxes]
    meshes: dict[int, tuple[Any, list[int]]] = {}
    for i, p in enumerate(params):
        if is_dtensor(p):
            meshes.setdefault(id(p.device_mesh), (p.device_mesh, []))[1].append(i)
    if not meshes:
        return out
    from fp8sim.quantizer import max_across

    for mesh, idx in meshes.values():
        vals = torch.stack([amaxes[i].detach().reshape(()).to(torch.float32) for i in idx])
        for dim in range(mesh.ndim):
            vals = max_across(mesh.get_group(dim))(vals)
        for i, v in zip(idx, vals.tolist()):
            out[i] = v
    return out

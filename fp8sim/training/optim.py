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
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import numpy as np
import torch

from fp8sim.formats import FloatFormat, get_format

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
        if p.dtype != torch.float32:
            raise TypeError(f"Fp8AdamW: parameters must be float32, got {p.dtype}")
        amax = float(p.detach().abs().amax()) if p.numel() else 0.0
        scale = _pow2_scale(2.0 * amax, _FP16, 1.0)  # one binade of headroom
        master = (p.detach() * scale).to(torch.float16)  # float32 product is exact (pow2), RNE
        sinv = torch.tensor(1.0 / scale, dtype=torch.float32)
        p.copy_(master.float() * sinv)  # the model starts from its master's value
        self.state[p] = {
            "step": 0,
            "master": master,
            "master_scale_inv": sinv,
            "exp_avg": torch.zeros(p.shape, dtype=torch.uint8, device=p.device),
            "exp_avg_scale_inv": torch.tensor(1.0, dtype=torch.float32),
            "exp_avg_sq": torch.zeros(p.shape, dtype=torch.float16, device=p.device),
            "exp_avg_sq_scale_inv": torch.tensor(1.0, dtype=torch.float32),
            "w_amax": torch.tensor(amax, dtype=torch.float32),
            "m_amax": torch.tensor(0.0, dtype=torch.float32),
            "v_amax": torch.tensor(0.0, dtype=torch.float32),
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
        """The master weight of ``p`` decoded to float32."""
        st = self.state[p]
        return st["master"].float() * st["master_scale_inv"]

    def moments(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(m, v)`` of ``p`` decoded to float32."""
        st = self.state[p]
        m = self.backend.dequantize(st["exp_avg"], self.exp_avg_fmt, st["exp_avg_scale_inv"])
        v = st["exp_avg_sq"].float() * st["exp_avg_sq_scale_inv"]
        return m, v

    def state_bytes(self) -> dict[str, int]:
        """Bytes of the live state tensors: ``master``, ``exp_avg``, ``exp_avg_sq`` and the 0-d
        ``scales`` (decode factors and amaxes)."""
        out = {"master": 0, "exp_avg": 0, "exp_avg_sq": 0, "scales": 0}
        for st in self.state.values():
            for key, t in st.items():
                if not torch.is_tensor(t):
                    continue
                n = t.numel() * t.element_size()
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
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            for p in group["params"]:
                index += 1
                got = self._grad(p)
                if got is None:
                    continue
                grad, grad_sinv = got
                grad_sinv = float(np.float32(float(grad_sinv) * float(grad_scale)))
                st = self.state[p]
                st["step"] += 1
                t = st["step"]
                g_amax = float(self.backend.amax(grad)) * abs(grad_sinv)
                m_bound = beta1 * float(st["m_amax"]) * (1 + 2.0**-3) + (1 - beta1) * g_amax
                v_bound = beta2 * float(st["v_amax"]) + (1 - beta2) * g_amax * g_amax
                w_bound = float(st["w_amax"]) * abs(1 - lr * wd) + 2.0 * lr * update_bound(t, beta1, beta2)
                w_scale = _pow2_scale(w_bound * (1 + 2.0**-8), _FP16, 1.0 / float(st["master_scale_inv"]))
                m_scale = _pow2_scale(m_bound * (1 + 2.0**-8), self.exp_avg_fmt, 1.0 / float(st["exp_avg_scale_inv"]))
                v_scale = _pow2_scale(v_bound * (1 + 2.0**-8), _FP16, 1.0 / float(st["exp_avg_sq_scale_inv"]))
                seed = None
                if self.rounding == "stochastic":
                    seed = (self.seed * 0x9E3779B1 + t * 0x85EBCA77 + 3 * index) % 2**62
                res = self.backend.adam_step(
                    st["master"], st["master_scale_inv"], grad, st["exp_avg"], st["exp_avg_scale_inv"],
                    st["exp_avg_sq"], st["exp_avg_sq_scale_inv"], step=t, lr=lr, beta1=beta1, beta2=beta2,
                    eps=eps, weight_decay=wd, grad_scale_inv=grad_sinv, param_scale=w_scale,
                    exp_avg_scale=m_scale, exp_avg_sq_scale=v_scale, exp_avg_fmt=self.exp_avg_fmt,
                    rounding=self.rounding, seed=seed,
                )
                st["master_scale_inv"] = res.param_scale_inv.cpu()
                st["exp_avg_scale_inv"] = res.exp_avg_scale_inv.cpu()
                st["exp_avg_sq_scale_inv"] = res.exp_avg_sq_scale_inv.cpu()
                st["w_amax"], st["m_amax"], st["v_amax"] = (
                    res.param_amax.cpu(), res.exp_avg_amax.cpu(), res.exp_avg_sq_amax.cpu())
                p.copy_(st["master"].float() * st["master_scale_inv"].to(p.device))
        return loss

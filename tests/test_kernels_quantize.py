"""Launcher-level checks of the kernels beyond the backend conformance suite.

Stochastic rounding with k random bits, its unbiasedness (an independent property: the mean of
many stochastic roundings of one value approaches the value), N-d and empty inputs, the software
decode of every code of every format, and the Adam kernel on non-contiguous state.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fp8sim
from fp8sim.backends import get
from fp8sim.backends.cases import random_values
from fp8sim.emulator import decode_table
from fp8sim.kernels.dequantize import dequantize
from fp8sim.kernels.quantize import quantize

ONE = torch.tensor(1.0)


@pytest.mark.parametrize("srbits", [1, 3, 8, 32])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
def test_stochastic_srbits(fmt, srbits):
    x = torch.from_numpy(random_values(3 * 130, seed=srbits, spread=3.0)).reshape(3, 130)
    codes, _ = quantize(x, fmt, ONE, rounding="stochastic", seed=2**40 + 7, srbits=srbits)
    want = fp8sim.encode(x.numpy(), fmt, rounding="stochastic", seed=2**40 + 7, srbits=srbits)
    assert torch.equal(codes, torch.from_numpy(want))


def test_stochastic_rounding_is_unbiased():
    """x = 1 + 0.3 ulp(e4m3): P(round up) = 0.3; 4096 draws land within 4 sigma of it."""
    n = 4096
    x = torch.full((n,), 1.0 + 0.3 * 2.0**-3)
    codes, _ = quantize(x, "e4m3", ONE, rounding="stochastic", seed=12345)
    up = (codes == 0x39).float().mean().item()  # 0x38 = 1.0, 0x39 = 1.125
    assert set(codes.unique().tolist()) <= {0x38, 0x39}
    assert abs(up - 0.3) <= 4 * (0.3 * 0.7 / n) ** 0.5


def test_nd_empty_and_scalar_inputs():
    x = torch.from_numpy(random_values(2 * 3 * 50, seed=1)).reshape(2, 3, 50)
    codes, amax = quantize(x, "e5m2", torch.tensor(0.5))
    assert codes.shape == x.shape
    assert torch.equal(codes, torch.from_numpy(fp8sim.encode(x.numpy() * np.float32(0.5), "e5m2")))
    assert float(amax) == float(np.abs(x.numpy()).max())
    codes, amax = quantize(torch.zeros(0, 5), "e4m3", ONE)
    assert codes.shape == (0, 5) and float(amax) == 0.0
    codes, _ = quantize(torch.tensor(-3.3), "e4m3", ONE)
    assert codes.shape == () and int(codes) == int(fp8sim.encode(np.float32(-3.3), "e4m3"))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz", "e3m4", "e4m3b11fnuz",
                                 "e2m3", "e3m2", "e2m1", "e8m0", "fp16", "bf16"])
def test_decode_every_code(fmt):
    """The software decode equals the emulator's table for every code (NaN where NaN)."""
    f = fp8sim.get_format(fmt)
    if f.bits <= 8:
        codes = torch.arange(f.num_codes, dtype=torch.int32).to(torch.uint8)
    else:  # 16-bit: every 7th code and both ends keep the interpreter quick
        idx = np.unique(np.r_[np.arange(0, f.num_codes, 7), np.arange(256), f.num_codes - 256 + np.arange(256)])
        codes = torch.from_numpy(idx.astype(np.uint16))
    got = dequantize(codes, f, ONE).numpy()
    want = decode_table(f, np.float32)[codes.numpy().astype(np.int64)]
    assert np.array_equal(got, want, equal_nan=True)


def test_adam_non_contiguous_state_and_bf16_grad():
    rng = np.random.default_rng(0)
    shape = (40, 24)
    w = torch.from_numpy((rng.standard_normal((24, 40)) * 0.02 * 1024).astype(np.float16)).t()
    g = torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * 1e-3).to(torch.bfloat16)
    m = torch.from_numpy(rng.integers(0, 0x7E, shape, dtype=np.uint8))
    v = torch.from_numpy((rng.random(shape) * 1e-2).astype(np.float16))
    state = {"triton": [w.clone().t().contiguous().t(), m.clone(), v.clone()],
             "emulator": [w.contiguous().clone(), m.clone(), v.clone()]}
    assert not state["triton"][0].is_contiguous()
    kw = dict(step=7, lr=3e-4, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.01,
              grad_scale_inv=0.5, exp_avg_scale=64.0, param_scale=1000.0,
              exp_avg_sq_scale=4096.0)
    res = {}
    for name, (p, mm, vv) in state.items():
        res[name] = get(name).adam_step(p, 1 / 1024, g, mm, 1 / 128, vv, 1 / 2048, **kw)
    for a, b in zip(state["triton"], state["emulator"]):
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    for a, b in zip(res["triton"], res["emulator"]):
        assert torch.equal(a, b)


def test_rounding_carry_into_the_exponent():
    """The case Triton's interpreter gets wrong with its own fp32 -> fp8 conversion: a rounding
    that carries out of the mantissa (7.91 -> 8.0 in e4m3) and the max/NaN boundary."""
    x = torch.tensor([7.91, -7.91, 15.9, 0.2449, 464.0, 465.0])
    codes, _ = quantize(x, "e4m3", ONE)
    want = fp8sim.encode(x.numpy(), "e4m3")
    assert torch.equal(codes, torch.from_numpy(want))
    assert fp8sim.decode(codes.numpy(), "e4m3")[0] == 8.0


def test_many_programs_and_ragged_tails():
    """Small blocks: partial amaxes of many programs reduce right, ragged last blocks mask."""
    from fp8sim.kernels.adam import adam_step as adam_kernel
    from fp8sim.kernels.amax import amax
    from fp8sim.kernels.block_quantize import block_quantize
    from fp8sim.kernels.cast_transpose import cast_transpose
    from fp8sim.scaling import quantize_scaled

    x = torch.from_numpy(random_values(257 * 31, seed=21, spread=8.0)).reshape(257, 31)
    x[200, 30] = -1e6  # the max sits in the last, ragged program
    want = fp8sim.encode(x.numpy() * np.float32(2.0), "e4m3", rounding="stochastic", seed=5)
    codes, a = quantize(x, "e4m3", torch.tensor(2.0), rounding="stochastic", seed=5, block=128)
    assert torch.equal(codes, torch.from_numpy(want)) and float(a) == 1e6
    assert float(amax(x[:, ::2], block=64)) == float(np.abs(x.numpy()[:, ::2]).max())
    c, ct, a = cast_transpose(x, "e4m3", torch.tensor(2.0), rounding="stochastic", seed=5, block=16)
    assert torch.equal(c, torch.from_numpy(want)) and torch.equal(ct, c.t()) and float(a) == 1e6
    vals = dequantize(codes, "e4m3", torch.tensor(0.5), block=256)
    assert torch.equal(vals, torch.from_numpy(fp8sim.decode(want, "e4m3") * np.float32(0.5)))
    st = quantize_scaled(x.numpy(), "e4m3", "mx")
    c, s, _, _ = block_quantize(x, "e4m3", "mx", budget=64)  # 2 rows per program
    assert torch.equal(c, torch.from_numpy(st.codes)) and torch.equal(s, torch.from_numpy(st.scale_inv))
    # Adam with 128-element programs against the emulator backend's recipe
    rng = np.random.default_rng(2)
    p = torch.from_numpy((rng.standard_normal(1000) * 30).astype(np.float16))
    m = torch.from_numpy(rng.integers(0, 0x7E, 1000, dtype=np.uint8))
    v = torch.from_numpy((rng.random(1000) * 0.1).astype(np.float16))
    g = torch.from_numpy(rng.standard_normal(1000).astype(np.float32))
    ref = [t.clone() for t in (p, m, v)]
    want_res = get("emulator").adam_step(ref[0], 1 / 1024, g, ref[1], 1 / 16, ref[2], step=2, lr=0.01)
    from fp8sim.backends.base import adam_constants
    scal = torch.tensor([1 / 1024, 1 / 16, 1.0, 1.0, 1024.0, 16.0, 1.0])
    got_amax = adam_kernel(p, g, m, v, scal, adam_constants(2, 0.01, 0.9, 0.999, 1e-8, 0.0), block=128)
    assert torch.equal(p.view(torch.int16), ref[0].view(torch.int16))
    assert torch.equal(m, ref[1]) and torch.equal(v.view(torch.int16), ref[2].view(torch.int16))
    assert torch.equal(got_amax, torch.stack([want_res.param_amax, want_res.exp_avg_amax,
                                              want_res.exp_avg_sq_amax]))


def test_every_bfloat16_input_widens_exactly():
    """Every bfloat16 bit pattern (subnormals too, which Triton's interpreter's own bfloat16 ->
    float32 conversion gets wrong) goes into the cast as its exact float32 value."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    x = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
    xf = (bits.astype(np.uint32) << 16).view(np.float32)
    scale = np.float32(2.0**127)  # bfloat16 subnormals (2**-133 .. 2**-126) -> e5m2 normals
    codes, _ = quantize(x, "e5m2", torch.tensor(float(scale)))
    with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN patterns scaled, as the kernel does
        want = fp8sim.encode(xf * scale, "e5m2")
    assert torch.equal(codes, torch.from_numpy(want))

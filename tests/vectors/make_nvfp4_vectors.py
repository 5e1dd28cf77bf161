"""Write tests/vectors/nvfp4_reference.npz: NVFP4 codes and scales from torchao and compressed-tensors.

torchao and compressed-tensors are too heavy for the test extra (and pull their own torch), so
their outputs are committed with this script. Run it where both import, e.g. installed beside
fp8sim's environment without touching it::

    pip install --no-deps --target /tmp/refs torchao compressed-tensors loguru
    PYTHONPATH=/tmp/refs python tests/vectors/make_nvfp4_vectors.py

Versions used for the committed file: see the ``versions`` entry in the .npz.
The inputs are float32 (M, 64) arrays, K a multiple of 16 as both libraries need. For each case
the file holds ``<case>/x`` and, per library, the packed codes (uint8, element 2k in the low
nibble), the block scales as E4M3 codes (uint8), the per-tensor float32 the library stores, and
the dequantized float32 values.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from torchao.prototype.mx_formats.nvfp4_tensor import (NVFP4Tensor, nvfp4_quantize,
                                                         per_tensor_amax_to_scale)
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy, QuantizationType
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

OUT = Path(__file__).with_name("nvfp4_reference.npz")


def cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2509)
    out = {}
    # block magnitudes spread over 2**-30 .. 2**12: E4M3 subnormal and clamped block scales
    mags = np.exp2(rng.uniform(-30, 12, size=(48, 4))).astype(np.float32)
    x = rng.standard_normal((48, 64)).astype(np.float32) * np.repeat(mags, 16, axis=1)
    x[3, 16:32] = 0.0  # a zero block
    x[5, :16] = -0.0
    out["spread"] = x
    out["randn"] = rng.standard_normal((64, 64)).astype(np.float32)
    # heavy tails: a few outliers per row
    y = rng.standard_normal((32, 64)).astype(np.float32)
    y[rng.random(y.shape) < 0.02] *= 300.0
    out["outliers"] = y
    # values on E2M1 rounding ties once scaled (amax 6 * 448 per tensor and block: scale 1)
    t = np.tile(np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75,
                            -2.5, -3.5, -5.0, 6.0, 0.0]), (4, 4))
    t[:, 14] = 2688.0
    out["ties_amax2688"] = t
    out["tiny"] = (rng.standard_normal((16, 64)) * 1e-30).astype(np.float32)
    out["huge"] = (rng.standard_normal((16, 64)) * 1e30).astype(np.float32)
    out["zeros"] = np.zeros((16, 64), np.float32)
    return out


def torchao_ref(x: torch.Tensor, two_level: bool):
    pts = per_tensor_amax_to_scale(x.abs().max()) if two_level else None
    scales, packed = nvfp4_quantize(x, 16, pts)
    t = NVFP4Tensor(packed, scales, 16, torch.float32, pts)
    deq = t.dequantize(torch.float32)
    ts = np.float32(pts.item()) if two_level else np.float32(1.0)
    return packed.numpy(), scales.view(torch.uint8).numpy(), ts, deq.numpy()


def ct_ref(x: torch.Tensor):
    args = QuantizationArgs(num_bits=4, type=QuantizationType.FLOAT,
                            strategy=QuantizationStrategy.TENSOR_GROUP, symmetric=True,
                            group_size=16, scale_dtype=torch.float8_e4m3fn,
                            zp_dtype=torch.float8_e4m3fn)
    gs = generate_gparam(x.min(), x.max())
    g = x.reshape(x.shape[0], -1, 16)
    scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args, global_scale=gs)
    q = quantize(x, scale, zp, args, global_scale=gs)
    deq = dequantize(q, scale, zp, args, global_scale=gs)
    return (pack_fp4_to_uint8(q).numpy(), scale.to(torch.float8_e4m3fn).view(torch.uint8).numpy(),
            np.float32(gs.item()), deq.numpy().astype(np.float32))


def main() -> int:
    import compressed_tensors
    import torchao

    data = {"versions": np.array(f"torch {torch.__version__}; torchao {torchao.__version__}; "
                                 f"compressed-tensors {compressed_tensors.__version__}")}
    for name, x in cases().items():
        xt = torch.from_numpy(x.copy())
        data[f"{name}/x"] = x
        for lib, fn in (("torchao", lambda: torchao_ref(xt, True)),
                        ("torchao-block", lambda: torchao_ref(xt, False)),
                        ("compressed-tensors", lambda: ct_ref(xt))):
            packed, scodes, ts, deq = fn()
            data[f"{name}/{lib}/packed"] = packed
            data[f"{name}/{lib}/scale_codes"] = scodes.reshape(x.shape[0], -1)
            data[f"{name}/{lib}/tensor_scale"] = np.float32(ts)
            data[f"{name}/{lib}/dequantized"] = deq.reshape(x.shape)
    np.savez_compressed(OUT, **data)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

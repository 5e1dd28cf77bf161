"""Check your own float32 -> FP8 E4M3 cast against fp8sim's emulator, bit for bit.

Two casts are checked with ``fp8sim.testing.assert_bitexact``:

* ``my_cast`` -- a software cast in torch with a classic bug: when the mantissa rounds up
  to 2.0 it wraps to 1.0 without carrying into the exponent (Triton 3.9's interpreter does
  this: 7.91 -> 4.0). The check fails and prints the report.
* torch's own ``float8_e4m3fn`` cast -- round to nearest even, saturating: bit-exact.

Run: ``python examples/check_your_kernel.py``
"""

from __future__ import annotations

import numpy as np
import torch

from fp8sim.testing import assert_bitexact


def my_cast(x: torch.Tensor) -> torch.Tensor:
    """float32 -> E4M3 codes (uint8), saturating, ties to even -- but the carry is lost."""
    sign = torch.where(torch.signbit(x), 0x80, 0).to(torch.int32)
    a = torch.nan_to_num(x.abs().double(), nan=0.0, posinf=448.0)
    binade = torch.clamp(torch.floor(torch.log2(a.clamp(min=2.0**-126))), min=-6)  # emin -6
    quantum = torch.exp2(binade - 3)  # 3 mantissa bits
    steps = torch.round(a / quantum)  # ties to even
    steps = torch.where((steps == 16) & (a >= 2.0**-6), 8, steps)  # BUG: the carry is lost
    mag = torch.clamp(steps * quantum, max=448.0)
    e = torch.clamp(torch.floor(torch.log2(mag.clamp(min=2.0**-126))), min=-6)
    code = torch.where(mag < 2.0**-6, mag / 2.0**-9, (e + 7) * 8 + mag / torch.exp2(e - 3) - 8)
    code = code.to(torch.int32) | sign
    return torch.where(torch.isnan(x), 0x7F | sign, code).to(torch.uint8)


def main() -> None:
    try:
        assert_bitexact(my_cast, "e4m3", device="cpu", inputs=np.float32([7.91]))
    except AssertionError as report:
        print(f"my_cast FAILS the check:\n{report}\n")
    else:
        raise SystemExit("my_cast passed: the check missed its bug")

    assert_bitexact(lambda x: x.to(torch.float8_e4m3fn), "e4m3", device="cpu")
    print("torch's float8_e4m3fn cast: bit-exact to fp8sim.encode(x, 'e4m3') "
          "(round to nearest even, saturating)")


if __name__ == "__main__":
    main()

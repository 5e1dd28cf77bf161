"""Check your own casts and kernels against the emulator, bit for bit.

For anyone who writes a float -> FP8 cast (numpy, torch, Triton, CUDA through torch)::

    import torch
    from fp8sim.testing import assert_bitexact

    assert_bitexact(lambda x: x.to(torch.float8_e4m3fn), "e4m3", device="cpu")

* :func:`assert_bitexact` -- ``fn(x) -> codes`` against ``fp8sim.encode`` (any format,
  rounding mode and overflow rule) on the format's edge cases and hypothesis draws.
* :func:`assert_scaled_bitexact` -- ``fn(x) -> (codes, scale_inv)`` against
  ``fp8sim.scaling.quantize_scaled`` (tensor, row, col, block:RxC, mx, mx:rceil), the scale
  rule included.
* value sets and hypothesis strategies for your own property tests: ``representable``,
  ``ties``, ``near_ties``, ``specials``, ``boundary_values``, ``values``, ``arrays``, ``codes``
  (see :mod:`fp8sim.testing.strategies`).

hypothesis is a dependency of fp8sim, imported only when a strategy is built or an assertion
draws arrays (``max_examples=0`` checks the fixed edge cases only, without it).
"""

from fp8sim.testing.assertions import assert_bitexact
from fp8sim.testing.scaled import assert_scaled_bitexact
from fp8sim.testing.strategies import (
    arrays,
    boundary_values,
    codes,
    edge_values,
    near_tie_values,
    near_ties,
    representable,
    representable_values,
    special_values,
    specials,
    tie_values,
    ties,
    values,
)

__all__ = [
    "assert_bitexact",
    "assert_scaled_bitexact",
    "edge_values",
    "representable_values",
    "tie_values",
    "near_tie_values",
    "special_values",
    "codes",
    "representable",
    "ties",
    "near_ties",
    "specials",
    "boundary_values",
    "values",
    "arrays",
]

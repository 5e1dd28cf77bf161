"""ZeRO placement (FP8-LM Algorithm 1) and the O3 weight store on one rank."""

import itertools
import math

import numpy as np
import pytest
import torch

import fp8sim
from fp8sim.training.zero import ZeroFp8Weights, place_tensors

E4M3 = fp8sim.get_format("e4m3")


def test_algorithm_1_by_hand():
    # largest first (ties by index): 7(#1) 7(#3) 5(#0) 3(#2) 2(#4) 2(#5), each to the least-loaded
    # rank (ties: lowest): r0 7 | r1 7 | r0 12 | r1 10 | r1 12 | r0 14
    assert place_tensors([5, 7, 3, 7, 2, 2], 2) == [0, 0, 1, 1, 1, 0]
    assert place_tensors([4, 4, 4], 3) == [0, 1, 2]
    assert place_tensors([9, 1, 1, 1], 2) == [0, 1, 1, 1]
    assert place_tensors([], 4) == [] and place_tensors([3, 2], 1) == [0, 0]


def _loads(sizes, owner, n):
    load = [0] * n
    for s, o in zip(sizes, owner):
        load[o] += s
    return load


@pytest.mark.parametrize("n", [2, 3, 4])
def test_greedy_balance_bounds_against_brute_force(n):
    rng = np.random.default_rng(n)
    for _ in range(20):
        sizes = [int(x) for x in rng.integers(1, 100, size=int(rng.integers(1, 8)))]
        load = _loads(sizes, place_tensors(sizes, n), n)
        best = min(max(_loads(sizes, a, n)) for a in itertools.product(range(n), repeat=len(sizes)))
        assert sum(load) == sum(sizes)
        assert max(load) <= (4 / 3 - 1 / (3 * n)) * best + 1e-9  # Graham's bound for largest-first
        assert max(load) - min(load) <= max(sizes)  # the last tensor on the fullest rank went to the emptiest


def test_place_tensors_validation():
    with pytest.raises(ValueError, match="ranks"):
        place_tensors([1], 0)
    with pytest.raises(ValueError, match=">= 0"):
        place_tensors([-1], 2)


def test_zero_store_on_one_rank_keeps_e4m3_weights_with_their_scales():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.LayerNorm(40))
    named = list(net.named_parameters())
    grads = {n: torch.randn_like(p) * 1e-2 for n, p in named}
    zero = ZeroFp8Weights(named, {"0.weight"}, rank=0, world=1,
                          optimizer_kwargs={"lr": 1e-2, "grad_source": lambda p: (grads[_name(named, p)], 1.0)})
    assert zero.loads() == [sum(p.numel() for _, p in named)]
    for _ in range(3):
        zero.step()
    w = net[0].weight.detach()
    codes, sinv = zero.codes["0.weight"], zero.scale_inv["0.weight"]
    assert codes.dtype == torch.uint8 and torch.equal(w, fp8sim.decode(codes, E4M3) * sinv)
    # the scale is 2**floor(log2(448 / amax(master))): a power of two, never saturating
    master = zero.optimizer.master_value(net[0].weight)
    assert sinv == 2.0 ** -math.floor(math.log2(448 / float(master.abs().max())))
    assert float(w.abs().max()) <= 448 * float(sinv)
    # E4M3 with a power-of-two scale: re-casting the stored weight (the forward's cast) is exact
    s = 2.0 ** math.floor(math.log2(448 / float(w.abs().max())))
    assert torch.equal(fp8sim.decode(fp8sim.encode(w * s, E4M3), E4M3) / s, w)
    # the other parameters hold their FP16 masters' values
    for n, p in named[1:]:
        assert torch.equal(p.detach(), zero.optimizer.master_value(p)), n
    assert zero.weight_bytes() == 40 * 24 + 4 + 4 * (40 + 40 + 40)


def _name(named, p):
    return next(n for n, q in named if q is p)

"""FP8-LM on torch.distributed, 2 processes over gloo: the FP8 all-reduce against the float32
all-reduce of the dequantized gradients, the DDP hook, 1-rank vs 2-rank gradients, O1/O2 (DDP)
and O3 (FSDP2) training, byte counts. One launch runs every check (process start-up dominates)."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

import fp8sim
from fp8sim.training.distributed import CommCounter, Fp8GradReducer, memory_breakdown, ring_bytes
from tests.conftest import tiny_train_config
from tests.dist_harness import run_ranks

WORLD = 2
E4M3 = fp8sim.get_format("e4m3")
SHAPES = {"a.weight": (37, 24), "b.weight": (16, 5)}  # odd sizes: the uint8 payload needs padding


def _grads(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    out = {n: torch.randn(s, generator=g) * 10.0 ** (-3 - rank) for n, s in SHAPES.items()}
    out["a.bias"] = torch.randn(37, generator=g) * 1e-2
    return out


def _tiny_cfg(recipe: str, steps: int = 8):
    return tiny_train_config(recipe, steps=steps)


def _rank_run(rank: int, world: int, cfg, out: str, **options):
    """One rank's training loop, a fresh run in ``out``."""
    from fp8sim.training.distributed import DataParallel
    from fp8sim.training.trainer import Trainer

    return Trainer(cfg, out, data_parallel=DataParallel(rank, world, **options), start="fresh")


def _session_checks(rank: int, world: int, tmp) -> dict:
    import torch.distributed as dist

    from fp8sim.training.fsdp_fp8 import local_data

    res: dict = {}

    # 1. the reducer on fixed gradients
    grads = _grads(rank)
    params = {n: torch.nn.Parameter(torch.zeros_like(g)) for n, g in grads.items()}
    counter = CommCounter(world)
    red = Fp8GradReducer(params.items(), set(SHAPES), world=world, counter=counter)
    outs = red.reduce([(params[n], grads[n]) for n in grads])
    res["reduce"] = {n: o for n, o in zip(grads, outs)}
    res["stash"] = {n: red.stash[id(params[n])] for n in grads}
    res["bytes"] = counter.pop()
    res["mu"] = {n: red.policy.mu(n) for n in SHAPES}

    # 1a. rank 1's gradients all zero: they set no bound on the shared scale (the minimum)
    zg = {n: grads[n] if rank == 0 else torch.zeros_like(grads[n]) for n in SHAPES}
    red_z = Fp8GradReducer(params.items(), set(SHAPES), world=world)
    red_z.reduce([(params[n], zg[n]) for n in SHAPES])
    res["zero_rank_sinv"] = {n: float(red_z.stash[id(params[n])][1]) for n in SHAPES}

    # 2. the DDP hook gives what reduce() gives on the local gradients
    torch.manual_seed(0)
    net = torch.nn.Linear(24, 37)
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(rank))
    local = torch.func.grad(lambda w, b: (torch.nn.functional.linear(x, w, b) ** 2).sum(), argnums=(0, 1))(
        net.weight.detach(), net.bias.detach())
    direct = Fp8GradReducer(net.named_parameters(), {"weight"}, world=world)
    want = direct.reduce([(net.weight, local[0]), (net.bias, local[1])])
    hooked = Fp8GradReducer(net.named_parameters(), {"weight"}, world=world)
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    ddp.register_comm_hook(None, hooked.hook)
    (ddp(x) ** 2).sum().backward()
    res["hook"] = {"want": want, "got": [net.weight.grad.clone(), net.bias.grad.clone()]}

    # 3. 2-rank vs 1-rank gradients over the same global batch (fp8lm-o1 model, step 1)
    # (mu starts at 1/2: headroom for the sum of 2 ranks from the first step)
    cfg, scaling = _tiny_cfg("fp8lm-o1"), "autoscale:mu_init=0.5"
    two = _rank_run(rank, world, cfg, os.path.join(tmp, "grad2"), grad_scaling=scaling)
    one = _rank_run(0, 1, cfg, os.path.join(tmp, f"grad1-{rank}"), grad_scaling=scaling) if rank == 0 else None
    ref = _rank_run(0, 1, _tiny_cfg("fp32"), os.path.join(tmp, f"ref-{rank}")) if rank == 0 else None
    res["grads"] = {}
    for name, run in (("two", two), ("one", one), ("ref", ref)):
        if run is None:
            continue
        run.forward_backward(1)  # this rank's rows of batch 1; gradients reduced over the ranks
        if name == "one":  # one rank: the FP8 quantization of the all-reduce runs in the optimizer step
            items = [(p, p.grad) for p in run.params]
            for (p, _), g in zip(items, run.dp.reducer.reduce(items)):
                p.grad = g
        res["grads"][name] = {n: p.grad.clone() for n, p in run.model.named_parameters()}
        if name == "two":
            res["grads"]["fp8_names"] = sorted(run.dp.fp8_names)
            res["grads"]["grad_fp8_names"] = sorted(run.dp.grad_fp8_names)

    # 4. O1 / O2 / O3 train (the run loop of `fp8sim train --nproc 2`)
    for level in (1, 2, 3):
        run = _rank_run(rank, world, _tiny_cfg(f"fp8lm-o{level}"), os.path.join(tmp, f"o{level}"))
        run.run(progress=False)
        if level == 3:  # FSDP2: each rank holds its rows of every tensor
            res["o3"] = {"full": {n: p.detach().full_tensor() for n, p in run.model.named_parameters()},
                         "local": {n: local_data(p).clone() for n, p in run.model.named_parameters()}}
    # 4b. the global gradient norm (for clipping) of O3, whose gradients live on their owners,
    # against O2's, whose every rank holds all of them: step 1, both gradient scopes
    res["norms"] = {}
    for scope in ("all", "linear"):
        for level in (2, 3):
            run = _rank_run(rank, world, _tiny_cfg(f"fp8lm-o{level}", steps=1),
                            os.path.join(tmp, f"norm-o{level}-{scope}"), fp8_grads=scope)
            res["norms"][level, scope] = run.train_step(1)["grad_norm"]
    # 5. bf16 baseline over 2 ranks: its communication bytes
    _rank_run(rank, world, _tiny_cfg("bf16", steps=2), os.path.join(tmp, "bf16")).run(progress=False)
    dist.barrier()
    return res


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    return tmp, run_ranks(_session_checks, WORLD, tmp)


def _half_ulp_e4m3(y: torch.Tensor) -> torch.Tensor:
    a = y.abs().double()
    return 2.0 ** (torch.floor(torch.log2(torch.clamp(a, min=2.0**-6))) - 4)


def test_fp8_allreduce_equals_float32_allreduce_of_dequantized_within_one_rounding(session):
    _, res = session
    g = [_grads(r) for r in range(WORLD)]
    for name in SHAPES:
        out0, out1 = res[0]["reduce"][name], res[1]["reduce"][name]
        assert torch.equal(out0, out1)  # every rank ends with the same gradient
        # the shared scale: min over ranks of AutoScale's mu * 448 / amax (mu = 1 at the first step)
        s = min(float(np.float32(448) / np.float32(float(gr[name].abs().max()))) for gr in g)
        s32 = torch.tensor(s, dtype=torch.float32)
        deq = [fp8sim.decode(fp8sim.encode(gr[name] * s32, E4M3), E4M3).double() for gr in g]  # each rank's FP8
        exact_sum = sum(deq)  # in units of the scale; the float32 all-reduce of the dequantized grads / s
        avg = exact_sum / (s * WORLD)
        tol = _half_ulp_e4m3(exact_sum) / (s * WORLD) + torch.from_numpy(np.spacing(out0.abs().numpy())).double()
        sat = exact_sum.abs() > 464  # rounds above E4M3's max: saturates (mu = 1 leaves no headroom)
        assert torch.all(((out0.double() - avg).abs() <= tol)[~sat]), name
        assert torch.allclose(out0[sat].double().abs(), torch.full_like(avg[sat], 448 / (s * WORLD)), rtol=1e-6)
        codes, _ = res[0]["stash"][name]
        at_max = bool(((codes & 0x7F) == E4M3.max_code).any())
        # AutoScale halves mu when sums land on +-448 (share > 0.001%), else grows it towards 2
        assert res[0]["mu"][name] == res[1]["mu"][name] == (0.5 if at_max else 2 ** (1 / 1000))
        codes, sinv = res[0]["stash"][name]
        assert codes.dtype == torch.uint8 and float(sinv) == float(torch.reciprocal(s32) / WORLD)
        assert torch.equal(out0, fp8sim.decode(codes, E4M3) * sinv)
    # the bias went through a bfloat16 all-reduce: bf16(bf16(g0) + bf16(g1)) / 2
    b = sum(gr["a.bias"].to(torch.bfloat16) for gr in g).float() / WORLD
    assert torch.equal(res[0]["reduce"]["a.bias"], b.to(torch.bfloat16).float())


def test_a_rank_with_zero_gradients_does_not_set_the_shared_scale(session):
    # FP8-LM's min over ranks of mu * 448 / amax: an all-zero rank (amax 0) gives no bound, so
    # the shared scale is rank 0's, not the 1 that the amax-0 rule would force on everyone
    _, res = session
    g0 = _grads(0)
    for name in SHAPES:
        s = np.float32(np.float32(448) / np.float32(float(g0[name].abs().max())))
        want = float(np.float32(np.float32(1) / s) / np.float32(WORLD))
        assert res[0]["zero_rank_sinv"][name] == res[1]["zero_rank_sinv"][name] == want, name


def test_bytes_sent_per_rank(session):
    _, res = session
    fp8_numel = sum(math.prod(s) for s in SHAPES.values())
    padded = fp8_numel + (-fp8_numel) % WORLD
    b = res[0]["bytes"]
    # all_to_all + all_gather of the uint8 payload: (N-1)/N each; scales: one float32 all_reduce
    assert b["wgrad_fp8"] == 2 * ring_bytes("all_to_all", padded, WORLD) == padded
    assert b["scales"] == ring_bytes("all_reduce", 4 * len(SHAPES), WORLD) == 8
    assert b["wgrad_bf16_equiv"] == ring_bytes("all_reduce", 2 * fp8_numel, WORLD)
    assert b["grads_other"] == ring_bytes("all_reduce", 2 * 37, WORLD)
    assert (b["wgrad_fp8"] + b["scales"]) / b["wgrad_bf16_equiv"] <= 0.55


def test_ddp_hook_matches_direct_reduce(session):
    _, res = session
    for r in range(WORLD):
        want, got = res[r]["hook"]["want"], res[r]["hook"]["got"]
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    assert torch.equal(res[0]["hook"]["got"][0], res[1]["hook"]["got"][0])


def test_two_rank_gradients_equal_one_rank_within_quantization_error(session):
    """The same global batch on 2 ranks and on 1: the gradients (fp8lm-o1 sends every one in
    E4M3, each within 2**-4 of its value per element) differ by at most 2**-3 relative (two
    roundings). And the FP8 linears' weight gradients on 2 ranks are no further from the float32
    model's than on 1 rank (the FP8 GEMMs make both a few % off)."""
    _, res = session
    two, one, ref = (res[0]["grads"][k] for k in ("two", "one", "ref"))
    fp8_weights = set(res[0]["grads"]["fp8_names"])
    assert len(fp8_weights) == 4  # the FP8 linears' weights
    assert set(res[0]["grads"]["grad_fp8_names"]) == set(two)  # fp8_grads=all: every gradient in E4M3
    assert all(torch.equal(two[n], res[1]["grads"]["two"][n]) for n in two)
    for name in two:
        rel = float((two[name] - one[name]).norm() / one[name].norm())
        assert rel <= 2**-3, (name, rel)
        if name in fp8_weights:  # FP8 GEMM error dominates the weight gradients
            err2, err1 = (float((g[name] - ref[name]).norm() / ref[name].norm()) for g in (two, one))
            assert err2 <= 1.25 * err1 + 0.01, (name, err2, err1)


def test_o1_o2_o3_train_with_decreasing_loss(session):
    tmp, _ = session
    for level in (1, 2, 3):
        rows = [json.loads(line) for line in open(tmp / f"o{level}" / "metrics.jsonl")]
        assert len(rows) == 8
        losses = [r["loss"] for r in rows]
        assert sum(losses[-3:]) / 3 < losses[0] - 0.2, (level, losses)
        run = json.loads((tmp / f"o{level}" / "run.json").read_text())
        assert run["nproc"] == WORLD and run["comm_bytes_per_step"]["wgrad_fp8_vs_bf16"] <= 0.55
        mem = run["memory_bytes_per_param"]["fp8_weights"]
        ranks = [m["fp8_weights"] for m in run["memory_bytes_per_param_ranks"]]
        if level == 2:  # FP8-LM's count: FP16 master 2 + E4M3 grad 1 + E4M3 m 1 + FP16 v 2 (+ scales)
            assert 6 <= mem["fp8lm"] <= 6.02 and mem["grads"] <= 1.01, mem
            whole = run["memory_bytes_per_param"]  # every parameter (fp8_grads=all), per-tensor scalars aside
            n_tensors = 2 + 12 * 1 + 2  # wte, wpe; 12 per block; ln_f
            assert whole["fp8lm"] == pytest.approx(6 + 28 * n_tensors / whole["parameters"], abs=1e-9), whole
        if level == 3:  # FSDP2: the float32 weights, the gradients, masters and moments all sharded
            assert run["engine"] == "fsdp2"
            assert all(m["weights"] == 2 and 0 < m["grads"] < 1 for m in ranks), ranks
            assert 1 <= sum(m["grads"] for m in ranks) <= 1.01  # E4M3 codes (+ a scale per tensor)
            assert 5 <= sum(m["master"] + m["optimizer"] for m in ranks) <= 5.02
            # FP8 reduce-scatter: (N-1)/N of the codes, no all-gather of gradients
            c = run["comm_bytes_per_step"]
            assert c["wgrad_fp8"] < 0.75 * json.loads((tmp / "o2" / "run.json").read_text())["comm_bytes_per_step"][
                "wgrad_fp8"]
            assert c["wgrad_bf16_equiv"] == 2 * c["wgrad_fp8"] and c["weights"] > 0
    bf16 = json.loads((tmp / "bf16" / "run.json").read_text())
    assert bf16["memory_bytes_per_param"]["fp8lm"] == pytest.approx(16, abs=0.01)
    o2 = json.loads((tmp / "o2" / "run.json").read_text())
    # whole-step communication: every gradient in FP8 (nothing in bf16) vs every gradient in bf16
    assert o2["comm_bytes_per_step"]["grads_other"] == 0 < bf16["comm_bytes_per_step"]["grads_other"]
    assert o2["comm_bytes_per_step"]["wgrad_bf16_equiv"] == bf16["comm_bytes_per_step"]["grads_other"]


def test_o3_gradient_norm_from_owned_shards_equals_the_replicated_norm(session):
    _, res = session
    for r in range(WORLD):
        for scope in ("all", "linear"):  # "linear": the bf16 gradients are on every rank, counted once
            o2, o3 = res[r]["norms"][2, scope], res[r]["norms"][3, scope]
            assert o3 == pytest.approx(o2, rel=1e-6), (scope, o2, o3)


def test_o3_weights_are_sharded_by_fsdp2_and_identical_on_every_rank(session):
    _, res = session
    a, b = res[0]["o3"], res[1]["o3"]
    for n, w in a["full"].items():
        assert torch.equal(w, b["full"][n]), n
        rows = -(-w.shape[0] // WORLD)
        assert torch.equal(a["local"][n], w[:rows]) and torch.equal(b["local"][n], w[rows:]), n


def test_one_process_reducer_and_memory_without_collectives():
    # world 1: no process group needed; the FP8 gradient is the E4M3 cast with mu * 448 / amax
    torch.manual_seed(1)
    lin = torch.nn.Linear(8, 16)
    red = Fp8GradReducer(lin.named_parameters(), {"weight"}, world=1)
    g = torch.randn(16, 8)
    out = red.reduce([(lin.weight, g)])[0]
    s = torch.tensor(float(np.float32(448) / np.float32(float(g.abs().max()))))
    assert torch.equal(out, fp8sim.decode(fp8sim.encode(g * s, E4M3), E4M3) * torch.reciprocal(s))
    lin.weight.grad = None
    opt = torch.optim.AdamW(lin.parameters())
    mem = memory_breakdown(lin, opt, reducer=red, fp8_names={"weight"})
    assert mem["fp8_weights"]["grads"] == pytest.approx((128 + 4) / 128)  # codes + scale_inv
    with pytest.raises(ValueError, match="gradient scaling"):
        Fp8GradReducer(lin.named_parameters(), set(), world=1, scaling="nope")


def test_fp8lm_recipes():
    from fp8sim.recipes import get_recipe

    o1, o2, o3 = (get_recipe(f"fp8lm-o{k}") for k in (1, 2, 3))
    assert all(r.grad_comm == "fp8" and r.linear.weight_grad.fmt.name == "e4m3" for r in (o1, o2, o3))
    assert (o1.optimizer, o2.optimizer, o3.optimizer) == ("adamw", "fp8-adamw", "fp8-adamw")
    assert (o1.weight_storage, o2.weight_storage, o3.weight_storage) == ("fp32", "fp32", "fp8")
    assert o1.grad_scaling == "autoscale" and o1.fp8_grads == "all"


def test_cli_trains_fp8lm_in_one_process_and_compares(tmp_path, capsys):
    from fp8sim import cli

    small = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "4",
             "--steps", "3", "--warmup", "1", "--eval-every", "3", "--checkpoint-every", "3"]
    a, b = str(tmp_path / "fp32"), str(tmp_path / "o2")
    assert cli.main(["train", "--recipe", "fp8lm-o2", "--out", b, "--json", *small]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["nproc"] == 1 and s["steps_done"] == 3 and s["memory_bytes_per_param"]["master"] > 0
    assert s["comm_bytes_per_step"]["wgrad_fp8"] == 0  # one rank sends nothing
    assert cli.main(["train", "--recipe", "fp32", "--out", a, *small]) == 0
    capsys.readouterr()
    assert cli.main(["compare", a, b]) == 0
    text = capsys.readouterr().out
    assert "bytes/param master" in text and "bytes/param fp8lm" in text
    assert cli.main(["train", "--recipe", "bf16", "--nproc", "3", "--out", str(tmp_path / "x"), *small]) == 2  # 4 % 3

"""FP8 linears on torch.distributed's own engines, 2 gloo ranks, one launch for every check:

* FSDP2 (``convert_to_fp8`` then ``fully_shard``) trains bit for bit as DDP on the same per-rank
  batches (5 AdamW steps, te-delayed / te-current / te-block / mx / nvfp4), the amaxes MAX-reduced
  over the ranks, the scaling states identical on every rank;
* a DCP checkpoint of the FSDP2 run (model, optimizer, FP8 state as tensors) loads into one
  process: resharded 2 -> 1 rank;
* FP8-LM O3: FSDP2's reduce-scatter in FP8 equals the O1/O2 DDP hook on each rank's shard, bit
  for bit; the all-gathered weights are the E4M3 cast of the masters; ``state_dict()`` plain;
* tensor parallelism (ColwiseParallel / RowwiseParallel, either order with the conversion) on a
  2-layer MLP and a tiny Llama attention block: the forward's FP8 codes and scales are the
  single-process ones, sliced; outputs equal the K-halves reference.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn as nn

import fp8sim
from fp8sim.quantizer import QuantizedTensor
from fp8sim.training import convert_to_fp8, get_fp8_state
from fp8sim.training.checkpoint import from_storable, to_storable
from tests.dist_harness import run_ranks

WORLD = 2
FSDP_RECIPES = ("te-delayed", "te-current", "te-block", "mx", "nvfp4")
TP_RECIPES = ("te-current", "mx")
ORDERS = ("convert-first", "parallelize-first")
FP8_GRAD_NAMES = {"0.weight", "1.weight", "0.bias"}  # "1.bias" travels in bfloat16


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 32))


def batch(step: int, rank: int | None = None) -> torch.Tensor:
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(100 + step))
    return x if rank is None else x[rank * 8 : (rank + 1) * 8]


def train(model: nn.Module, rank: int | None, steps: int = 5) -> tuple[torch.optim.Optimizer, list[float]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses = []
    for s in range(steps):
        loss = (model(batch(s, rank)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return opt, losses


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole tensor, a plain one (not the AsyncCollectiveTensor full_tensor gives)."""
    f = t.detach().full_tensor()
    return (f.wait() if hasattr(f, "wait") else f).clone()


def casts_of(state) -> dict:
    """A tap keeping every observed cast: (tensor name, role) -> (codes, scale_inv), first one."""
    seen: dict = {}

    def tap(name, role, x, cast, scale, op):
        seen.setdefault((name, role), (op.codes.clone(), op.scale_inv.clone(), op.amax))

    state.taps.append(tap)
    return seen


def llama_block(seed: int = 0) -> nn.Module:
    from tests.test_byom_convert import tiny_llama

    llama = tiny_llama(seed)

    class Block(nn.Module):  # the attention of a tiny Llama, with its rotary embedding
        def __init__(self) -> None:
            super().__init__()
            self.attn = llama.model.layers[0].self_attn
            self.rotary = llama.model.rotary_emb

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(x.shape[1])[None]
            return self.attn(x, self.rotary(x, pos), attention_mask=None)[0]

    return Block()


TP_PLANS = {
    "mlp": {"0": "colwise", "2": "rowwise"},
    "llama": {"attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise", "attn.o_proj": "rowwise"},
}


def tp_model(kind: str) -> nn.Module:
    if kind == "mlp":
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    return llama_block()


def tp_input(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(16, 64, generator=g) if kind == "mlp" else torch.randn(2, 8, 64, generator=g)


# -- the ranks' session --------------------------------------------------------------------------


def _session(rank: int, world: int, tmp) -> dict:
    return {"fsdp": _fsdp_vs_ddp(rank, tmp), "rs": _reduce_scatter_vs_hook(rank), "o3": _o3(rank),
            "tp": _tensor_parallel()}


def _fsdp_vs_ddp(rank: int, tmp) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from fp8sim.training.dist_checkpoint import save_state

    out = {}
    for recipe in FSDP_RECIPES:
        a = convert_to_fp8(mlp(), recipe)
        seen = casts_of(get_fp8_state(a))
        _, la = train(nn.parallel.DistributedDataParallel(a), rank)
        b = convert_to_fp8(mlp(), recipe)
        for i in (0, 2, 4):
            fully_shard(b[i])
        fully_shard(b)
        opt, lb = train(b, rank)
        out[recipe] = {
            "ddp": la, "fsdp": lb, "amax0": seen[("0.input", "activation")][2],
            "w_ddp": {n: p.detach().clone() for n, p in a.named_parameters()},
            "w_fsdp": {n: _full(p) for n, p in b.named_parameters()},
            "fp8_ddp": to_storable(get_fp8_state(a).state_dict()),
            "fp8_fsdp": to_storable(get_fp8_state(b).state_dict()),
        }
        if recipe == "te-delayed":  # a DCP checkpoint, loaded by one process in the test
            save_state(tmp / "dcp", b, opt, extra={"note": "fsdp te-delayed after 5 steps"})
            out[recipe]["exp_avg"] = {n: _full(opt.state[p]["exp_avg"]) for n, p in b.named_parameters()}
    dist.barrier()
    return out


def _reduce_scatter_vs_hook(rank: int) -> dict:
    """The FP8 reduce-scatter of a plain float model (no E4M3 all-gather: both paths see the same
    local gradients) against the DDP hook's reduce of the same gradients."""
    import torch.distributed as dist

    from fp8sim.training.fp8_allreduce import Fp8GradReducer
    from fp8sim.training.fsdp_fp8 import fully_shard_fp8lm

    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(24, 37), nn.Linear(37, 16))  # 37 rows: uneven shards, padded
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(rank)) * 10.0 ** (-rank)
    f = copy.deepcopy(net)
    (net(x) ** 2).sum().backward()
    hook = Fp8GradReducer(net.named_parameters(), FP8_GRAD_NAMES, world=WORLD, group=dist.group.WORLD)
    named = list(net.named_parameters())
    want = dict(zip([n for n, _ in named], hook.reduce([(p, p.grad) for _, p in named])))
    red = Fp8GradReducer(f.named_parameters(), FP8_GRAD_NAMES, world=WORLD, group=dist.group.WORLD)
    fully_shard_fp8lm(f, red, units=[f[0], f[1]])
    (f(x) ** 2).sum().backward()
    got = {n: p.grad.to_local().clone() for n, p in f.named_parameters()}
    return {"want": want, "got": got,
            "codes_want": {n: hook.stash[id(p)][0] for n, p in named if n in FP8_GRAD_NAMES},
            "codes_got": {n: red.stash[id(p)][0] for n, p in f.named_parameters() if n in FP8_GRAD_NAMES},
            "mu_hook": {n: hook.policy.mu(n) for n in FP8_GRAD_NAMES},
            "mu_fsdp": {n: red.policy.mu(n) for n in FP8_GRAD_NAMES}}


def _o3(rank: int) -> dict:
    import torch.distributed as dist

    from fp8sim.training import fp8lm
    from fp8sim.training.data import get_batch, load_corpus
    from fp8sim.training.fsdp_fp8 import local_data
    from fp8sim.training.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32))
    run = fp8lm.prepare(model, "fp8lm-o3", process_group=dist.group.WORLD, lr=1e-2)
    fc = model.blocks[0].mlp.c_fc
    gathered = []
    fc.register_forward_pre_hook(lambda m, args: gathered.append(m.weight.detach().clone()))
    corpus = load_corpus(max_bytes=2**16)
    masters, losses = [], []
    for step in range(1, 3):
        x, y = get_batch(corpus, "train", step - 1, 4, 16, 0)
        masters.append(_full(fc.weight))
        run.optimizer.zero_grad()
        _, loss = model(x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2])
        loss.backward()
        run.optimizer.step(max_norm=1.0)
        losses.append(float(loss.detach()))
    st = run.optimizer.optimizer.state[fc.weight]
    sd = model.state_dict()
    return {"local_type": type(fc.weight._local_tensor).__name__, "gathered": gathered, "masters": masters,
            "sd_local_types": sorted({type(local_data(v)).__name__ for v in sd.values() if torch.is_tensor(v)}),
            "sd_plain": all(type(v._local_tensor if hasattr(v, "_local_tensor") else v) is torch.Tensor
                            for v in sd.values() if torch.is_tensor(v)),
            "scalars": {k: v for k, v in st.items() if torch.is_tensor(v) and v.dim() == 0},
            "master_state_shape": tuple(local_data(st["master"]).shape), "losses": losses}


def _tensor_parallel() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (WORLD,))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    out = {}
    for kind in TP_PLANS:
        plan = {name: styles[s]() for name, s in TP_PLANS[kind].items()}
        for recipe in TP_RECIPES if kind == "mlp" else ("te-current",):
            for order in ORDERS:
                m = tp_model(kind)
                if order == "convert-first":
                    convert_to_fp8(m, recipe)
                    parallelize_module(m, mesh, plan)
                else:
                    parallelize_module(m, mesh, plan)
                    convert_to_fp8(m, recipe)
                seen = casts_of(get_fp8_state(m))
                y = m(tp_input(kind))
                (y**2).mean().backward()
                out[kind, recipe, order] = {"casts": {k: v[:2] for k, v in seen.items()}, "y": y.detach(),
                                            "types": sorted({type(mod).__name__ for mod in m.modules()})}
    return out


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engines")
    return tmp, run_ranks(_session, WORLD, tmp)


# -- FSDP2 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", FSDP_RECIPES)
def test_fsdp2_trains_bit_for_bit_as_ddp_with_reduced_amaxes(session, recipe):
    _, res = session
    for r in range(WORLD):
        got = res[r]["fsdp"][recipe]
        assert got["fsdp"] == got["ddp"], (r, got["fsdp"], got["ddp"])
        for n, w in got["w_ddp"].items():
            assert torch.equal(w, got["w_fsdp"][n]), n
        assert _same(got["fp8_ddp"], got["fp8_fsdp"])
        # the first layer's input amax of step 1 is the global batch's (MAX over both ranks' rows)
        assert got["amax0"] == float(batch(0).abs().max())
    assert _same(res[0]["fsdp"][recipe]["fp8_fsdp"], res[1]["fsdp"][recipe]["fp8_fsdp"])  # identical on every rank
    assert res[0]["fsdp"][recipe]["ddp"] != res[1]["fsdp"][recipe]["ddp"]  # the ranks saw different rows


def test_a_dcp_checkpoint_of_fsdp2_loads_into_one_process(session):
    from fp8sim.training.dist_checkpoint import load_state

    tmp, res = session
    ref = res[0]["fsdp"]["te-delayed"]
    model = convert_to_fp8(mlp(), "te-delayed")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    extra = load_state(tmp / "dcp", model, opt)  # 2 ranks' shards -> one process's full tensors
    assert extra == {"note": "fsdp te-delayed after 5 steps"}
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), ref["w_fsdp"][n]), n
        assert torch.equal(opt.state[p]["exp_avg"], ref["exp_avg"][n]), n
    assert _same(to_storable(get_fp8_state(model).state_dict()), ref["fp8_fsdp"])
    hist = from_storable(ref["fp8_fsdp"])["policies"]["activation"]["tensors"]["0.input"]
    assert hist  # the delayed-scaling history travelled as tensors and came back


# -- FP8-LM O3 -------------------------------------------------------------------------------------


def test_fp8_reduce_scatter_equals_the_ddp_hook_on_each_shard(session):
    _, res = session
    for r in range(WORLD):
        rs = res[r]["rs"]
        for n, want in rs["want"].items():
            rows = -(-want.shape[0] // WORLD)
            shard = want[r * rows : (r + 1) * rows]
            assert torch.equal(rs["got"][n], shard), n  # bit for bit, padded rows excluded
        for n, codes in rs["codes_want"].items():
            rows = -(-codes.shape[0] // WORLD)
            assert torch.equal(rs["codes_got"][n], codes[r * rows : (r + 1) * rows]), n
        assert rs["mu_fsdp"] == rs["mu_hook"]  # AutoScale saw the same sums at max on every rank
    assert res[0]["rs"]["mu_fsdp"] == res[1]["rs"]["mu_fsdp"]


def test_o3_all_gathers_e4m3_weights_and_keeps_plain_state_dicts(session):
    _, res = session
    e4m3 = fp8sim.get_format("e4m3")
    for r in range(WORLD):
        o3 = res[r]["o3"]
        assert o3["local_type"] == "Fp8AllGatherWeight" and o3["sd_plain"] and o3["sd_local_types"] == ["Tensor"]
        assert o3["master_state_shape"] == (64, 32)  # (128, 32) sharded over 2 ranks
        for master, got in zip(o3["masters"], o3["gathered"]):
            # MS-AMP's weight scale 2**floor(log2(448 / amax)) of the whole tensor, by hand
            s = 2.0 ** math.floor(math.log2(448 / float(master.abs().max())))
            want = fp8sim.decode(fp8sim.encode(master.double().numpy() * s, e4m3), e4m3) / s
            assert np.array_equal(got.numpy(), want.astype(np.float32))
    a, b = res[0]["o3"], res[1]["o3"]
    assert all(torch.equal(a["scalars"][k], b["scalars"][k]) for k in a["scalars"])  # global amaxes
    assert a["losses"] != b["losses"]


# -- tensor parallelism ------------------------------------------------------------------------------


def _reference(kind: str, recipe: str) -> tuple[dict, torch.Tensor, object]:
    m = tp_model(kind)
    convert_to_fp8(m, recipe, amax_reduction=None)
    seen = casts_of(get_fp8_state(m))
    full: dict = {}

    def keep(name, role, x, cast, scale, op):
        full.setdefault((name, role), op)

    get_fp8_state(m).taps.append(keep)
    y = m(tp_input(kind))
    (y**2).mean().backward()
    return {k: v[:2] for k, v in seen.items()}, y.detach(), (get_fp8_state(m), full, m)


def _shard(t: torch.Tensor, style: str, role: str, r: int) -> torch.Tensor:
    """Rank r's part of a single-process forward cast (codes or a scale grid) under a TP style."""
    if t.dim() == 0:
        return t
    if style == "colwise":  # weight rows; the input is replicated
        return t.chunk(WORLD, 0)[r] if role == "weight" else t
    return t.chunk(WORLD, 1)[r]  # row-wise: input and weight columns (K)


@pytest.mark.parametrize("kind, recipe", [("mlp", r) for r in TP_RECIPES] + [("llama", "te-current")])
def test_tensor_parallel_casts_are_the_single_process_ones_sliced(session, kind, recipe):
    _, res = session
    want, _, _ = _reference(kind, recipe)
    layer_style = {name: style for name, style in TP_PLANS[kind].items()}
    for r in range(WORLD):
        for order in ORDERS:
            got = res[r]["tp"][kind, recipe, order]
            assert "Fp8Linear" in got["types"]
            forward = {k for k in want if k[1] in ("activation", "weight")}
            assert forward <= set(got["casts"]), (order, forward - set(got["casts"]))
            for (name, role), (codes, sinv) in want.items():
                if role not in ("activation", "weight"):  # the backward follows outputs that differ in rounding
                    continue
                layer = name.rsplit(".", 1)[0]
                style = layer_style[layer]
                g_codes, g_sinv = got["casts"][name, role]
                assert torch.equal(g_codes, _shard(codes, style, role, r)), (order, name, role)
                assert torch.equal(g_sinv, _shard(sinv, style, role, r)), (order, name, role)


@pytest.mark.parametrize("kind, recipe", [("mlp", r) for r in TP_RECIPES] + [("llama", "te-current")])
def test_tensor_parallel_outputs_sum_the_k_halves_in_rank_order(session, kind, recipe):
    _, res = session
    _, _, (state, full, model) = _reference(kind, recipe)
    last = [n for n, s in TP_PLANS[kind].items() if s == "rowwise"][0]
    xq, wq = full[f"{last}.input", "activation"], full[f"{last}.weight", "weight"]
    halves = [state.gemm(_k_half(xq, r), _k_half(wq, r)) for r in range(WORLD)]
    y = halves[0] + halves[1]
    bias = model.get_submodule(last).bias
    if bias is not None:
        y = y + bias.detach()
    for r in range(WORLD):
        for order in ORDERS:
            got = res[r]["tp"][kind, recipe, order]["y"]
            assert torch.equal(got.reshape(y.shape), y), (r, order)


def _k_half(q: QuantizedTensor, r: int) -> QuantizedTensor:
    from dataclasses import replace

    sinv = q.scale_inv if q.scale_inv.dim() == 0 else q.scale_inv.chunk(WORLD, 1)[r]
    return replace(q, codes=q.codes.chunk(WORLD, 1)[r], scale_inv=sinv)


def test_tensor_parallel_refuses_blocks_that_straddle_ranks():
    from fp8sim.training.tensor_parallel import _check_block_alignment

    layer = convert_to_fp8(nn.Sequential(nn.Linear(64, 64)), "te-block")[0]
    with pytest.raises(ValueError, match="not a multiple of the activation cast's block:1x128 blocks"):
        _check_block_alignment(layer, "rowwise", 32)


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b

"""fp8lm.prepare: every level of an FP8-LM recipe on your own model, in one call."""

import json

import numpy as np
import pytest
import torch

from fp8sim.training import fp8lm, get_fp8_state
from fp8sim.training.fp8_linear import Fp8Linear
from fp8sim.training.fp8_state import decode_extra_state
from fp8sim.training.optim import Fp8AdamW
from tests.test_byom_convert import tiny_llama, tokens


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _cfg(recipe):
    from fp8sim.training.model import GPTConfig
    from fp8sim.training.trainer import TrainConfig

    return TrainConfig(recipe=recipe, steps=4, batch_size=4, lr=1e-2, warmup=2, eval_every=0, eval_batches=1,
                       checkpoint_every=0, max_bytes=2**16, model=GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32))


@pytest.mark.parametrize("recipe", ["fp8lm-o1", "fp8lm-o2", "fp8lm-o3"])
def test_prepare_trains_as_the_built_in_data_parallel_loop_bit_for_bit(tmp_path, recipe):
    """A user loop over prepare()'s model and optimizer gives train_distributed's losses (one
    rank) on the same model, data, schedule and clipping: every level is applied the same way."""
    from fp8sim.training.data import get_batch, load_corpus
    from fp8sim.training.distributed import train_distributed
    from fp8sim.training.model import GPT

    cfg = _cfg(recipe)
    train_distributed(cfg, tmp_path / "ref", nproc=1)
    ref = [json.loads(line)["loss"] for line in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]

    corpus = load_corpus(cfg.data, max_bytes=cfg.max_bytes)
    torch.manual_seed(cfg.seed)
    run = fp8lm.prepare(GPT(cfg.model), recipe, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    assert run.comm_hook is None  # one process
    losses = []
    for step in range(1, cfg.steps + 1):
        x, y = get_batch(corpus, "train", step - 1, cfg.batch_size, cfg.model.block_size, cfg.seed)
        for g in run.optimizer.param_groups:
            g["lr"] = cfg.lr_at(step)
        run.optimizer.zero_grad()
        _, loss = run.model(x, y)
        loss.backward()
        run.optimizer.step(max_norm=cfg.grad_clip)
        losses.append(float(loss.detach()))
    assert losses == ref


def test_prepare_applies_each_level_to_a_llama():
    from fp8sim import decode, get_format

    e4m3 = get_format("e4m3")
    runs = {r: fp8lm.prepare(tiny_llama(), r, lr=1e-3) for r in ("fp8lm-o1", "fp8lm-o2", "fp8lm-o3")}
    for name, run in runs.items():
        assert sum(isinstance(m, Fp8Linear) for m in run.model.modules()) == 14
        assert "weight_grad" in get_fp8_state(run.model).casts  # O1: E4M3 weight gradients
        x = tokens(1)
        run.optimizer.zero_grad()
        run.model(x, labels=x).loss.backward()
        if name == "fp8lm-o1":  # float32 AdamW on the FP8 all-reduce's gradients: E4M3 values x scale
            run.optimizer.step()
            assert isinstance(run.optimizer.optimizer, torch.optim.AdamW)
            g = run.model.model.layers[0].mlp.up_proj.weight.grad
            stash, sinv = run.optimizer.reducer.stash[id(run.model.model.layers[0].mlp.up_proj.weight)]
            assert stash.dtype == torch.uint8
            assert torch.equal(g, decode(stash, e4m3).view(g.shape) * sinv)
            continue
        run.optimizer.step(max_norm=1.0)
        opt = run.optimizer.optimizer
        assert isinstance(opt, Fp8AdamW)
        st = opt.state[run.model.model.layers[0].mlp.up_proj.weight]
        assert st["exp_avg"].dtype == torch.uint8 and st["exp_avg_sq"].dtype == torch.float16  # O2
        assert st["master"].dtype == torch.float16
        if name == "fp8lm-o3":  # one process: the FP8 linears' weights are their E4M3 cast after the step
            import math

            from fp8sim import encode

            w = run.model.model.layers[0].mlp.up_proj.weight.detach()
            assert ("model.layers.0.mlp.up_proj.weight", run.model.model.layers[0].mlp.up_proj.weight) in [
                (n, p) for n, p in run.optimizer.fp8_weights]
            s = 2.0 ** math.floor(math.log2(448 / float(w.abs().max())))  # MS-AMP's weight scale, by hand
            assert torch.equal(w, decode(encode(w.double() * s, e4m3), e4m3).float() / s)
    # AutoScale's state travels in the model's state dict (in the first FP8 layer's extra state)
    sd = runs["fp8lm-o2"].model.state_dict()
    extra = decode_extra_state(sd["model.layers.0.self_attn.q_proj._extra_state"], "q_proj")["extra"][fp8lm.REDUCER_STATE_KEY]
    assert extra["scaling"] == "autoscale" and extra["policy"]["tensors"]
    fresh = fp8lm.prepare(tiny_llama(), "fp8lm-o2")
    fresh.model.load_state_dict(sd)
    assert fresh.optimizer.reducer.state_dict() == runs["fp8lm-o2"].optimizer.reducer.state_dict()
    with pytest.raises(ValueError, match="no FP8 linear"):
        fp8lm.prepare(tiny_llama(), "bf16")
    assert np.isfinite(runs["fp8lm-o3"].optimizer.counter.pop()["weights"])


@pytest.mark.parametrize("name", ["fp8lm-o1", "fp8lm-o2", "fp8lm-o3"])
def test_convert_to_fp8_refuses_the_fp8lm_levels_it_would_not_apply(name):
    from fp8sim.training import convert_to_fp8, get_recipe

    model = tiny_llama()
    for recipe in (name, get_recipe(name)):
        with pytest.raises(ValueError, match=rf"use fp8sim.training.fp8lm.prepare\(model, '{name}'\)"):
            convert_to_fp8(model, recipe)
        assert get_fp8_state(model) is None  # nothing converted
    convert_to_fp8(model, get_recipe(name).linear)  # the linear level alone, asked for explicitly
    assert get_fp8_state(model) is not None

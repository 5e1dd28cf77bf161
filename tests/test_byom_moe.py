"""Mixture-of-experts in FP8: transformers' experts modules become grouped FP8 GEMMs with one
scale set per expert, bit for bit a loop of per-expert FP8 linears; routers and the output layer
stay in high precision; what cannot be converted is named in one warning."""

import warnings

import pytest
import torch
import torch.nn as nn

from fp8sim.recipes import get_recipe
from fp8sim.training import convert_to_fp8, get_fp8_state
from fp8sim.training.experts import is_fp8_experts
from fp8sim.training.fp8_linear import Fp8Linear
from tests.test_byom_convert import tokens, transformers

E, D, F, K = 4, 32, 48, 2  # experts, hidden, ffn, top k


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread(one_torch_thread):
    yield


def _recipe(name):
    r = get_recipe(name)
    return r.linear if name.startswith("fp8lm") else r


def _experts(layout, seed=0):
    """A transformers experts module built from a config: Mixtral's (E, 2F, D) / (E, D, F), no
    bias, gate and up concatenated; GPT-OSS's (E, D, 2F) / (E, F, D) stored transposed, with
    biases and interleaved gate and up (its own clamped SwiGLU)."""
    tf = transformers()
    if layout == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts

        mod = MixtralExperts(tf.MixtralConfig(hidden_size=D, intermediate_size=F, num_local_experts=E))
    else:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        mod = GptOssExperts(tf.GptOssConfig(hidden_size=D, intermediate_size=F, num_local_experts=E))
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0, 0.2)
    return mod


class Holder(nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, x, idx, w):
        return self.experts(x, idx, w)


class PerExpertLoop(nn.Module):
    """The reference: one nn.Linear per expert and projection, named ``experts.{proj}.{e}`` as the
    grouped layer names its experts' tensors, on the same (stable, by expert) token order; the
    gating is the experts module's own, on all rows at once as in the grouped forward (torch's
    vectorized elementwise kernels round by position: per-expert calls would differ in the last
    bits outside the GEMMs)."""

    def __init__(self, hf):
        super().__init__()
        self.hf = [hf]  # not a submodule: only its gating is used
        self.experts = nn.ModuleDict()
        for proj in ("gate_up_proj" if hf.has_gate else "up_proj", "down_proj"):
            w = getattr(hf, proj).detach()
            b = getattr(hf, f"{proj}_bias").detach() if hf.has_bias else None
            layers = nn.ModuleList()
            for e in range(E):
                we = w[e].t() if hf.is_transposed else w[e]  # (out, in)
                lin = nn.Linear(we.shape[1], we.shape[0], bias=b is not None)
                with torch.no_grad():
                    lin.weight.copy_(we)
                    if b is not None:
                        lin.bias.copy_(b[e])
                layers.append(lin)
            self.experts[proj] = layers

    def forward(self, x, idx, w):
        hf = self.hf[0]
        ids, perm = torch.sort(idx.reshape(-1), stable=True)
        xs, ws = x[perm // K], w.reshape(-1)[perm]
        up, down = self.experts.values()
        rows = [(ids == e).nonzero().flatten() for e in range(E)]

        def linears(layers, h, width):  # each expert's rows through its own FP8 linear
            out = h.new_zeros(len(perm), width)
            for e in range(E):
                if len(rows[e]):
                    out = out.index_copy(0, rows[e], layers[e](h[rows[e]]))
            return out

        h = linears(up, xs, up[0].out_features)
        h = hf._apply_gate(h) if hf.has_gate else hf.act_fn(h)  # on all rows at once, as the grouped forward
        out = linears(down, h, D)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(len(perm))
        return (out * ws.unsqueeze(-1))[inv].view(-1, K, D).sum(1)


def _routing(step, tokens_=12):
    """Top-2 routing over experts 0, 1 and 3 (expert 2 gets no token), random weights."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(tokens_, D, generator=g)
    idx = torch.stack([torch.randperm(3, generator=g)[:K] for _ in range(tokens_)])
    idx = torch.where(idx == 2, 3, idx)
    w = torch.softmax(torch.randn(tokens_, K, generator=g), -1)
    return x, idx, w


CASES = [(r, "emulator", lay) for r in ("te-delayed", "te-current", "te-block", "mx", "nvfp4", "torchao-rowwise",
                                        "fp8lm-o1") for lay in ("mixtral", "gpt-oss")]
CASES += [("te-delayed", "torch", "gpt-oss"), ("te-block", "torch", "mixtral"), ("te-current", "triton", "mixtral")]


@pytest.mark.parametrize("recipe,backend,layout", CASES)
def test_grouped_experts_equal_a_loop_of_per_expert_fp8_linears_bit_for_bit(recipe, backend, layout):
    hf = _experts(layout)
    ref = convert_to_fp8(PerExpertLoop(hf), _recipe(recipe), backend)
    model = convert_to_fp8(Holder(hf), _recipe(recipe), backend)
    assert is_fp8_experts(model.experts) and isinstance(ref.experts["down_proj"][0], Fp8Linear)
    seen = []
    get_fp8_state(model).expert_taps.append(lambda name, role, x, cast, scale, op, expert: seen.append((name, expert)))
    # the second step's delayed scales come from the first; Triton in its CPU interpreter is
    # slow, and te-current has no state across steps: one step there
    for step in (1,) if backend == "triton" else (1, 2):
        x, idx, w = _routing(step)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = model(xa, idx, w), ref(xb, idx, w)
        assert torch.equal(ya, yb)
        g = torch.randn_like(ya)
        ya.backward(g)
        yb.backward(g)
        assert torch.equal(xa.grad, xb.grad)
    for proj, layers in ref.experts.items():
        grad = getattr(hf, proj).grad  # (E, out, in), or (E, in, out) stored transposed
        for e, lin in enumerate(layers):
            ge = grad[e].t() if hf.is_transposed else grad[e]
            if e == 2:  # no token was routed to it
                assert lin.weight.grad is None and not ge.any()
            else:
                assert torch.equal(ge, lin.weight.grad)
                if hf.has_bias:
                    assert torch.equal(getattr(hf, f"{proj}_bias").grad[e], lin.bias.grad)
    assert get_fp8_state(model).state_dict() == get_fp8_state(ref).state_dict()
    assert get_fp8_state(model).pop_events() == get_fp8_state(ref).pop_events()
    up = "gate_up_proj" if hf.has_gate else "up_proj"
    assert ("experts.down_proj.3.grad_output", 3) in seen and (f"experts.{up}.0.input", 0) in seen
    assert all(name.split(".")[2] == str(e) for name, e in seen) and 2 not in {e for _, e in seen}


@pytest.mark.parametrize("layout", ["mixtral", "gpt-oss"])
def test_fp8_experts_are_close_to_transformers_own_forward(layout):
    """The layout is read right: E4M3 experts stay within a few percent of transformers' own
    high-precision grouped_mm forward (a wrong transpose or gate split would not)."""
    hf, fp8 = _experts(layout), Holder(_experts(layout))
    convert_to_fp8(fp8, "te-current")
    x, idx, w = _routing(1, tokens_=64)
    ref, got = hf(x, idx, w), fp8(x, idx, w)
    assert hf.config._experts_implementation in ("grouped_mm", None)
    err = float((got - ref).detach().norm() / ref.detach().norm())
    assert 1e-4 < err < 0.08, err


def _tiny_moe(kind, seed=0, **overrides):
    tf = transformers()
    common = dict(vocab_size=128, hidden_size=D, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, num_experts_per_tok=K)
    if kind == "mixtral":
        cfg = tf.MixtralConfig(**common, intermediate_size=F, num_local_experts=E, **overrides)
        model_cls = tf.MixtralForCausalLM
    else:
        cfg = tf.Qwen2MoeConfig(**common, moe_intermediate_size=F, shared_expert_intermediate_size=2 * F, num_experts=E,
                                intermediate_size=2 * F, **overrides)
        model_cls = tf.Qwen2MoeForCausalLM
    torch.manual_seed(seed)
    return model_cls(cfg)


def _hand_macs(kind):
    """Linear MACs per token of one decoder layer outside the routers, from the config: attention
    q, k, v, o (4 heads of 8, 2 KV heads), the top-K of E experts, Qwen2-MoE's shared expert."""
    attn = D * D + 2 * D * (D // 2) + D * D
    experts = K * 3 * D * F
    shared = 3 * D * 2 * F if kind == "qwen2_moe" else 0
    return attn, experts + shared


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_moe_models_train_20_steps_with_every_linear_mac_but_the_head_and_routers_in_fp8(kind):
    model = _tiny_moe(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is left unconverted, so nothing is warned about
        convert_to_fp8(model, "te-delayed")
    s = get_fp8_state(model).summary
    attn, mlp = _hand_macs(kind)
    assert s.macs_per_token["fp8"] == 2 * (attn + mlp) and s.fp8_share == 1.0
    assert s.macs_per_token["output layer"] == D * 128
    assert s.macs_per_token["router"] == 2 * (D * E + (D if kind == "qwen2_moe" else 0))  # + shared_expert_gate
    reasons = {n: why for n, (_, why) in s.high_precision.items()}
    assert reasons["lm_head.weight"] == "output layer" and reasons["model.layers.0.mlp.gate.weight"] == "router"
    if kind == "qwen2_moe":  # the shared expert is converted, its scalar gate is a router
        assert isinstance(model.model.layers[0].mlp.shared_expert.up_proj, Fp8Linear)
        assert reasons["model.layers.1.mlp.shared_expert_gate.weight"] == "router"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    x = tokens(1, batch=4, seq=16)
    for _ in range(20):  # one batch, 20 steps: the loss must fall
        opt.zero_grad()
        loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        losses.append(float(loss))
    experts = model.model.layers[0].mlp.experts
    assert is_fp8_experts(experts) and experts.gate_up_proj.grad.abs().sum() > 0
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.8 * losses[0], losses


def test_module_filter_opts_experts_out_and_the_summary_shows_what_that_costs():
    model = _tiny_moe("mixtral")
    convert_to_fp8(model, "te-delayed", module_filter_fn=lambda m, fqn: not fqn.endswith("experts"))
    s = get_fp8_state(model).summary
    attn, mlp = _hand_macs("mixtral")
    assert not any(is_fp8_experts(m) for m in model.modules())
    assert s.high_precision["model.layers.0.mlp.experts.gate_up_proj"] == (E * 2 * F * D, "module_filter_fn")
    assert s.fp8_share == attn / (attn + mlp)  # the share fp8sim had before MoE experts ran in FP8
    assert "module_filter_fn" in str(s)


def test_modules_that_cannot_be_converted_are_named_in_one_warning_with_their_parameter_counts():
    class CustomMoE(nn.Module):  # 3-D expert weights behind no experts interface
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 8, 8))

        def forward(self, x):
            return x @ self.w.sum(0)

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8, 8), CustomMoE())
    with pytest.warns(UserWarning) as record:
        convert_to_fp8(model, "te-current")
    texts = [str(w.message) for w in record if "cannot convert" in str(w.message)]
    assert len(texts) == 1
    assert "0 (Conv2d, 216 parameters)" in texts[0] and "3 (CustomMoE, 256 parameters)" in texts[0]
    assert get_fp8_state(model).summary.not_converted == {"0": ("Conv2d", 216), "3": ("CustomMoE", 256)}


def test_mixtral_gradient_checkpointing_with_two_forwards_gives_the_same_gradients():
    from tests.test_byom_recompute import _contrastive_steps

    class Pooled(nn.Module):
        def __init__(self, ckpt):
            super().__init__()
            self.lm = _tiny_moe("mixtral")
            if ckpt:
                self.lm.activation_checkpointing_enable()
            convert_to_fp8(self.lm, "te-delayed")

        def forward(self, x):
            return self.lm(x, output_hidden_states=True).hidden_states[-1].mean(1)

    g_ref = _contrastive_steps(Pooled(False).train())
    g = _contrastive_steps(Pooled(True).train())
    for a, b in zip(g_ref, g):
        assert a.keys() == b.keys() and "lm.model.layers.1.mlp.experts.down_proj" in a
        assert [n for n in a if not torch.equal(a[n], b[n])] == []


def test_every_experts_implementation_the_fp8_forward_replaces_gives_the_same_result_and_others_are_refused():
    model = convert_to_fp8(_tiny_moe("mixtral"), "te-current").eval()  # eval: nothing observed, the scales stay
    assert model.config._experts_implementation == "grouped_mm"  # a Mixtral from a config
    x = tokens(1, batch=2, seq=8)
    out = {}
    for impl in ("grouped_mm", "eager", "batched_mm"):
        model.set_experts_implementation(impl)
        out[impl] = model(x).logits
    assert torch.equal(out["eager"], out["grouped_mm"]) and torch.equal(out["batched_mm"], out["grouped_mm"])
    model.config._experts_implementation = "deepgemm"  # set_experts_implementation would check the hardware first
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts: experts_implementation='deepgemm'; fp8sim's FP8 "
                                         r"experts replace eager, batched_mm, grouped_mm"):
        model(x)


def test_torch_compile_of_an_fp8_mixtral_is_one_graph_and_trains_as_eager_bit_for_bit():
    from torch._dynamo.testing import CompileCounterWithBackend

    tf = transformers()

    def run(counter):
        torch.manual_seed(0)
        model = tf.MixtralForCausalLM(tf.MixtralConfig(
            vocab_size=128, hidden_size=D, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=F, num_local_experts=E, num_experts_per_tok=K)).train()
        convert_to_fp8(model, "te-delayed")
        fwd = torch.compile(model, backend=counter) if counter else model
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for step in (1, 2):  # the second step casts with the first step's delayed scales
            x = tokens(step, batch=2, seq=8)
            loss = fwd(x, labels=x).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses, [p.detach().clone() for p in model.parameters()], get_fp8_state(model).state_dict()

    counter = CompileCounterWithBackend("aot_eager")
    (la, pa, sa), (lb, pb, sb) = run(None), run(counter)
    assert counter.frame_count == 1  # no graph break (the experts' token counts have a static shape)
    assert all(torch.equal(a, b) for a, b in zip(la, lb)) and all(torch.equal(a, b) for a, b in zip(pa, pb))
    assert sa == sb

"""The FP8 state travels in model.state_dict(): a resume in a fresh process continues bit for bit."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

from fp8sim.training import convert_to_fp8, get_fp8_state
from fp8sim.training.fp8_state import decode_extra_state
from tests.test_byom_convert import tiny_llama, tokens

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

# one script for both processes: train steps FIRST..LAST of a te-delayed tiny Llama (AdamW), after
# loading CKPT if it exists, saving model + optimizer state dicts to SAVE after step SAVE_AT;
# print the losses (float.hex) and the FP8 step
SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    from fp8sim.training import convert_to_fp8, get_fp8_state
    from tests.test_byom_convert import tiny_llama, tokens

    torch.set_num_threads(1)
    first, last, ckpt, save, save_at = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
    model = convert_to_fp8(tiny_llama(seed=1 if first > 1 else 0), "te-delayed")  # resumed: other init
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if first > 1:
        saved = torch.load(ckpt, weights_only=True)  # plain data: no pickled fp8sim objects
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
    state = get_fp8_state(model)
    out = {"step_loaded": state.step, "losses": []}
    for step in range(first, last + 1):
        x = tokens(step)
        opt.zero_grad()
        loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        out["losses"].append(float(loss).hex())
        if step == save_at:  # a checkpoint in the middle of the run, as a user's loop takes it
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, save)
    out["step_end"] = state.step
    print(json.dumps(out))
""")


def _run(first, last, ckpt="-", save="-", save_at=0):
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(first), str(last), ckpt, save, str(save_at)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_resume_from_model_and_optimizer_state_dicts_in_a_fresh_process_is_bit_exact(tmp_path):
    ck = str(tmp_path / "ck.pt")
    full = _run(1, 6, save=ck, save_at=3)  # uninterrupted, checkpointed after step 3
    tail = _run(4, 6, ckpt=ck)  # a fresh process resumes from that checkpoint
    assert tail["step_loaded"] == 3 and tail["step_end"] == 6 and full["step_end"] == 6  # no loop set it
    assert tail["losses"] == full["losses"][3:]


def test_extra_state_holds_each_layers_policies_and_a_plain_checkpoint_still_loads():
    model = convert_to_fp8(tiny_llama(), "te-delayed")
    model(tokens(1), labels=tokens(1)).loss.backward()
    sd = model.state_dict()
    extra = decode_extra_state(sd["model.layers.0.mlp.up_proj._extra_state"], "up_proj")
    assert sd["model.layers.0.mlp.up_proj._extra_state"].dtype == torch.uint8  # JSON bytes: any format stores it
    assert extra["step"] == 1
    assert set(extra["policies"]["activation"]["tensors"]) == {"model.layers.0.mlp.up_proj.input"}
    assert set(extra["policies"]["grad_output"]["tensors"]) == {"model.layers.0.mlp.up_proj.grad_output"}
    # a checkpoint saved before conversion loads strictly; the FP8 state stays as it is
    plain = {k: v for k, v in tiny_llama().state_dict().items()}
    fresh = convert_to_fp8(tiny_llama(seed=3), "te-delayed")
    before = get_fp8_state(fresh).state_dict()
    fresh.load_state_dict(plain)  # strict
    assert get_fp8_state(fresh).state_dict() == before
    # a state saved under another policy is refused, not silently mixed in
    other = convert_to_fp8(tiny_llama(), "te-current")
    with pytest.raises(ValueError, match="saved with policy"):
        other.load_state_dict(sd)


def test_a_layers_state_loads_into_a_model_with_only_that_layer_converted():
    src = convert_to_fp8(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), "te-delayed")
    torch.manual_seed(0)
    src(torch.randn(4, 8)).sum().backward()
    dst = convert_to_fp8(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), "te-delayed",
                         module_filter_fn=lambda m, fqn: fqn == "1")
    dst.load_state_dict(src.state_dict(), strict=False)
    got = get_fp8_state(dst).policies["activation"].state_dict()["tensors"]
    assert got == {"1.input": get_fp8_state(src).policies["activation"].state_dict()["tensors"]["1.input"]}

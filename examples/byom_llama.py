"""Bring your own model: a Hugging Face Llama trained with emulated FP8, recorded, replayed, judged.

    python examples/byom_llama.py --steps 50 --out byom-run

1. builds a tiny ``LlamaForCausalLM`` from a config (random init, CPU; needs ``transformers``);
2. converts its linear layers with ``convert_to_fp8(model, "te-delayed")`` (Transformer Engine's
   hybrid recipe: E4M3 activations and weights, E5M2 output gradients, delayed scaling; the
   ``lm_head`` stays in float32);
3. trains ``--steps`` steps of AdamW on random tokens while :func:`fp8sim.training.record` writes
   every cast into the trace ``OUT/trace`` (your own loop: the recorder and the FP8 step follow
   the model's training forwards by themselves);
4. saves ``model.state_dict()`` (the FP8 scaling state included) and the optimizer's to
   ``OUT/checkpoint.pt``;
5. replays the trace under other scaling policies with ``fp8sim replay`` (a subprocess, as you
   would run it), writing ``OUT/replay.json`` and printing its table;
6. prints the per-layer verdict of :func:`fp8sim.analysis.analyze` on the trace: for each layer
   and role, ``ok`` / ``needs margin N`` / ``needs finer scaling`` / ``keep in higher precision``,
   judged in the format the recipe gives that role, warm-up steps apart.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch


def build_llama(hidden: int, layers: int, vocab: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256)
    return LlamaForCausalLM(cfg)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--recipe", default="te-delayed")
    ap.add_argument("--out", type=Path, default=Path("byom-run"))
    args = ap.parse_args(argv)

    from fp8sim.training import convert_to_fp8, get_fp8_state, record

    model = build_llama(args.hidden, args.layers, args.vocab, args.seed)
    convert_to_fp8(model, args.recipe)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    trace = args.out / "trace"
    losses = []
    with record(model, trace):
        for step in range(1, args.steps + 1):
            x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
            optimizer.zero_grad(set_to_none=True)
            loss = model(x, labels=x).loss
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
            if step == 1 or step % 10 == 0 or step == args.steps:
                ev = get_fp8_state(model).pop_events()
                print(f"step {step:4d}  loss {losses[-1]:.4f}  overflow {ev['overflow']}  underflow {ev['underflow']}",
                      file=sys.stderr)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, args.out / "checkpoint.pt")

    replay_json = args.out / "replay.json"
    cmd = [sys.executable, "-m", "fp8sim", "replay", str(trace), "--policy", "delayed:history=16,margin=0,algo=max",
           "--policy", "current", "--policy", "current:pow2", "--json", str(replay_json)]
    subprocess.run(cmd, check=True)

    from fp8sim.analysis import analyze

    verdicts = analyze(trace).verdicts
    print("\nper-layer verdict (layer, role, format: verdict)")
    for v in verdicts:
        print(f"  {v.layer}  {v.role}  {v.format}: {v.text}")
    return {"losses": losses, "trace": str(trace), "replay": json.loads(replay_json.read_text()),
            "fp8_step": get_fp8_state(model).step, "verdicts": verdicts}


if __name__ == "__main__":
    main()

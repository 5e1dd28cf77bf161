"""Step overhead of ``fp8sim.training.record()``: the same training step with and without it.

Two models, each in four copies of the same initial weights -- not recorded, recorded with
``every=1``, with ``every=10``, and with ``every=10, observe_every_step=False`` (a plain model's
delayed policy then observes the recorded steps only; an FP8 model's own policies are unaffected):

* ``linear``: two ``nn.Linear(width, width)`` layers with a GELU between (a model that is *not*
  converted, as a user instruments a bf16/fp32 run: the recorder runs ``te-delayed``'s policies
  for the casts it would make);
* ``llama``: a tiny Hugging Face ``LlamaForCausalLM`` (2 layers, ``--llama-hidden``) built from a config and converted with
  ``convert_to_fp8(model, "te-delayed", backend="torch")`` (the recorder taps its live casts).

A block is ``--block`` consecutive training steps (forward, backward, SGD) of one copy. After
``--warmup`` untimed blocks, the copies take turns block by block for ``--rounds`` rounds (a load
spike on a shared machine hits all of them), and each recorded copy's median block time is
compared with the unrecorded copy's: overhead = median(recorded) / median(plain) - 1. The trace
is flushed after each block, untimed: the loop does not wait on the disk, which is what the
figure measures (the background thread's work still competes for the same cores).

    .venv/bin/python benchmarks/bench_record.py [--width 1024 --tokens 2048 --rounds 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn

from fp8sim.training import convert_to_fp8, record


def linear_model(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))


def llama_model(hidden: int, layers: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                      vocab_size=512, max_position_embeddings=4096)  # fmt: skip
    model = LlamaForCausalLM(cfg)
    return convert_to_fp8(model, "te-delayed", backend="torch")


def _copies(make, n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    first = make()
    out = [first]
    for _ in range(n - 1):
        torch.manual_seed(0)
        m = make()
        m.load_state_dict(first.state_dict())
        out.append(m)
    return out


def _step_fn(kind: str, model: nn.Module, args):
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    if kind == "linear":
        x = torch.randn(args.tokens, args.width, generator=g)

        def step() -> None:
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    else:
        seq = 128
        ids = torch.randint(0, 512, (max(1, args.tokens // seq), seq), generator=g)

        def step() -> None:
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()

    return step


def bench(kind: str, args, tmp: str) -> dict:
    make = (lambda: linear_model(args.width)) if kind == "linear" else (lambda: llama_model(args.llama_hidden, 2))
    models = _copies(make, 4)
    names = ["plain", "every=1", "every=10", "every=10,observe_every_step=False"]
    recs = [None, record(models[1], os.path.join(tmp, f"{kind}-1"), every=1, chunk_steps=50),
            record(models[2], os.path.join(tmp, f"{kind}-10"), every=10, chunk_steps=50),
            record(models[3], os.path.join(tmp, f"{kind}-10s"), every=10, chunk_steps=50, observe_every_step=False)]
    steps = [_step_fn(kind, m, args) for m in models]
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.warmup + args.rounds):
        for n, step, rec in zip(names, steps, recs):
            t0 = time.perf_counter()
            for _ in range(args.block):
                step()
            dt = time.perf_counter() - t0
            if rec is not None:
                rec.flush()
            if r >= args.warmup:
                times[n].append(dt / args.block)
    for rec in recs:
        if rec is not None:
            rec.close()
    med = {n: statistics.median(v) for n, v in times.items()}
    return {"model": kind, "width": args.width if kind == "linear" else args.llama_hidden, "tokens": args.tokens,
            "step_ms": {n: round(1e3 * v, 2) for n, v in med.items()},
            "overhead_pct": {n: round(100 * (med[n] / med["plain"] - 1), 1) for n in names[1:]},
            "per_round_overhead_pct": {n: [round(100 * (a / b - 1), 1) for a, b in zip(times[n], times["plain"])]
                                       for n in names[1:]}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per step (rows of the batch)")
    p.add_argument("--llama-hidden", type=int, default=256, help="the tiny Llama's hidden size (2 layers)")
    p.add_argument("--block", type=int, default=10, help="steps per timed block (every=10 records one)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--models", default="linear,llama")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
           "load": os.getloadavg()[0]}  # fmt: skip
    out = {"env": env, "results": []}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.models.split(","):
            res = bench(kind, args, tmp)
            out["results"].append(res)
            print(f"{kind:6s} width {res['width']} tokens {args.tokens}: step {res['step_ms']} ms; "
                  f"overhead {res['overhead_pct']} %", file=sys.stderr, flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

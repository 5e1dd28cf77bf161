"""Training step time: FP8 recipes (torch and emulator backends) against fp32, on CPU.

Ratios in one process on the same batches, never absolute times: each configuration trains the
same model for ``--warmup`` steps (not timed: numba compilation, allocator warm-up), then the
configurations take turns, one step each, for ``--steps`` rounds (so a load spike on a shared
machine hits all of them), and the median step time of each is compared with fp32's.

A step is what ``fp8sim train`` runs: forward, backward, gradient clipping, AdamW, including the
FP8 casts, amax bookkeeping and overflow/underflow counting.

A configuration is ``recipe/backend`` or ``recipe/backend/accumulate``: the FP8 GEMMs' arithmetic
(``float32``, the training default, or ``float64``; see ``fp8sim.training.fp8_linear``).

    .venv/bin/python benchmarks/bench_training.py [--n-embd 256 --n-layer 4 --block-size 128 --batch-size 16]

Needs only fp8sim's base install.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile

import torch

from fp8sim.training.data import load_corpus
from fp8sim.training.model import GPTConfig
from fp8sim.training.trainer import TrainConfig, Trainer

CONFIGS = ["fp32/emulator", "bf16/emulator", "te-delayed/torch", "te-delayed/emulator", "te-delayed/torch/float64",
           "te-current/torch", "mx/emulator"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma-separated recipe/backend[/accumulate] (float32 or float64)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    model = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    corpus = load_corpus(max_bytes=4 * 2**20)
    configs = [c.strip() for c in args.configs.split(",")]
    trainers = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(configs):
            recipe, backend, *acc = name.split("/")
            cfg = TrainConfig(recipe=recipe, backend=backend, steps=args.warmup + args.steps + 1,
                              batch_size=args.batch_size, model=model, checkpoint_every=0, eval_every=0)
            t = Trainer(cfg, os.path.join(tmp, f"run{i}"), corpus=corpus)
            if acc:
                if t.fp8 is None:
                    p.error(f"{name}: {recipe} has no FP8 GEMMs to set the accumulation of")
                t.fp8.gemm_accumulate = acc[0]
            for s in range(1, args.warmup + 1):
                t.train_step(s)
            trainers[name] = t
        times: dict = {k: [] for k in trainers}
        for i in range(args.steps):
            for k, t in trainers.items():
                times[k].append(t.train_step(args.warmup + 1 + i)["step_time_s"])
    med = {k: statistics.median(v) for k, v in times.items()}
    base = next((v for k, v in med.items() if k.split("/")[0] == "fp32"), None)
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch threads {torch.get_num_threads()}",
        "model": model.to_dict(),
        "batch": [args.batch_size, args.block_size],
        "steps_timed": args.steps,
        "median_step_ms": {k: 1e3 * v for k, v in med.items()},
        "ratio_to_fp32": {k: (v / base if base else None) for k, v in med.items()},
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"# {result['machine']}; model {model.n_layer}x{model.n_embd}, batch {args.batch_size}x{args.block_size}, "
              f"median of {args.steps} steps")
        print(f"{'recipe/backend':24}{'ms/step':>10}{'x fp32':>9}")
        for k, v in result["median_step_ms"].items():
            r = result["ratio_to_fp32"][k]
            print(f"{k:24}{v:10.1f}{(r or float('nan')):9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

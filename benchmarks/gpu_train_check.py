"""Train the tiny GPT on a CUDA device with the triton backend and with the emulator backend.

    python benchmarks/gpu_train_check.py [--steps 40] [--recipes te-delayed,mx,nvfp4] [--json out.json]

For each recipe: the same run (seed, batches, model) with ``--device cuda`` on the triton backend
(every cast and GEMM on the GPU) and on the emulator backend (the numba reference; its casts copy
through the host, said once). Checks, per recipe:

* the FP8 codes and scales of every cast of step 1 identical between the two backends;
* the loss curves within 1e-3 relative, step for step;
* tokens/s of each (median over the steps after the first, which compiles the kernels).

Prints one JSON line per recipe and a verdict; exit 1 if a check fails. Needs a CUDA GPU and
Triton (issue 29 item 6). It has not run on a GPU yet: the script itself was tried on a CPU-only
machine with ``--device cpu --backends torch,emulator --recipes te-delayed,mx --steps 3`` (24
step-1 casts identical per recipe, losses equal).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch


def run(recipe: str, backend: str, steps: int, out: Path, device: str) -> dict:
    from fp8sim.training.run_dir import read_metrics
    from fp8sim.training.trainer import Trainer, TrainConfig

    cfg = TrainConfig(recipe=recipe, backend=backend, steps=steps, eval_every=0, checkpoint_every=0, warmup=5)
    trainer = Trainer(cfg, out, device=device)
    assert next(trainer.model.parameters()).device.type == torch.device(device).type
    first: dict = {}

    def tap(name, role, x, cast, scale, op):  # the casts of step 1 (the first forward/backward)
        if trainer.fp8.step <= 1:
            first.setdefault((name, role), (op.codes.detach().cpu().clone(), op.scale_inv.detach().cpu().clone()))

    trainer.fp8.taps.append(tap)
    trainer.run(progress=False)
    rows = read_metrics(out)
    return {"casts": first, "loss": [r["loss"] for r in rows],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[1:]) if len(rows) > 1 else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--recipes", default="te-delayed,mx,nvfp4")
    ap.add_argument("--json", default=None, help="write the results there")
    ap.add_argument("--device", default="cuda", help="cuda (default); cpu only to try the script itself")
    ap.add_argument("--backends", default="triton,emulator", help="the two backends compared")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_train_check: no CUDA GPU", file=sys.stderr)
        return 2
    results, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in args.recipes.split(","):
            bes = args.backends.split(",")
            a, b = (run(recipe, be, args.steps, Path(tmp) / f"{recipe}-{be}", args.device) for be in bes)
            same_keys = set(a["casts"]) == set(b["casts"])
            differing = [f"{k[0]}:{k[1]}" for k in sorted(set(a["casts"]) & set(b["casts"]))
                         if not (torch.equal(a["casts"][k][0], b["casts"][k][0])
                                 and torch.equal(a["casts"][k][1], b["casts"][k][1]))]
            rel = max(abs(x - y) / abs(y) for x, y in zip(a["loss"], b["loss"]))
            row = {"recipe": recipe, "steps": args.steps, "step1_casts": len(a["casts"]),
                   "step1_codes_identical": same_keys and not differing, "step1_differing": differing[:5],
                   "max_rel_loss_diff": rel, f"tokens_per_s_{bes[0]}": a["tokens_per_s"],
                   f"tokens_per_s_{bes[1]}": b["tokens_per_s"], f"final_loss_{bes[0]}": a["loss"][-1],
                   f"final_loss_{bes[1]}": b["loss"][-1]}
            ok &= row["step1_codes_identical"] and rel <= 1e-3
            results.append(row)
            print(json.dumps(row), flush=True)
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(f"gpu_train_check: {'OK' if ok else 'FAILED'} ({where}, torch {torch.__version__})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

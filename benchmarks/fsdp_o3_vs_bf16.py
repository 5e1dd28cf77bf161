"""FP8-LM O3 on FSDP2 against bf16 FSDP2 on the same model, 2 gloo ranks (issue 29 item 4).

    python benchmarks/fsdp_o3_vs_bf16.py [--steps 300] [--backend torch] [--out DIR]

Both runs train the demo model (the default GPTConfig, 124,672 parameters) on the same batches
(global batch 16 x 128 bytes, rank r its half), seed 0, AdamW (lr 3e-3, betas 0.9/0.95, weight
decay 0.1, clipping at 1.0, the trainer's warm-up + cosine schedule):

* **O3**: ``fp8sim train --recipe fp8lm-o3 --nproc 2`` -- FSDP2 with the E4M3 weight all-gather
  and the FP8 reduce-scatter (``fp8sim.training.fsdp_fp8``); its bytes are the run's
  ``comm_bytes`` (counted from the collectives' tensors: the all-gather's output buffer, the
  reduce-scatter's all_to_all payloads and scale exchanges);
* **bf16**: the same model under ``fully_shard`` (each block a unit, then the root) with
  ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=bfloat16)``, float32 masters and
  torch's AdamW; its all-gather and reduce-scatter go through counting wrappers
  (``set_custom_all_gather`` / ``set_custom_reduce_scatter``) that add up the bytes of the tensors
  they pass on (all-gather: the gathered output; reduce-scatter: the input buffer).

Prints a JSON object: per run the mean of the last 10 training losses, bytes per step and rank
by collective, bytes per parameter held by a rank (its shards of weights, masters, gradients,
optimizer states over the parameter count); and the O3/bf16 loss ratio. Not a test: the output goes
into docs/training.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def _cfg(recipe: str, steps: int, backend: str):
    from fp8sim.training.trainer import TrainConfig

    return TrainConfig(recipe=recipe, backend=backend, steps=steps, eval_every=0, checkpoint_every=0)


class _CountingReduceScatter:
    def __init__(self, counter: dict) -> None:
        self.counter = counter

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        import torch.distributed as dist

        self.counter["reduce_scatter"] += input_tensor.numel() * input_tensor.element_size()
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # torch >= 2.13: the new name
        return scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def bf16_rank(steps: int, out: str) -> None:
    """One rank of the bf16 FSDP2 baseline (started by torchrun from :func:`main`)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fp8sim.training.data import get_batch, load_corpus
    from fp8sim.training.fsdp_fp8 import CountedAllGather, local_data
    from fp8sim.training.model import GPT

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    cfg = _cfg("bf16", steps, "torch")
    corpus = load_corpus(cfg.data, max_bytes=cfg.max_bytes)
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model)
    n_params = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    bytes_ = {"all_gather": 0, "reduce_scatter": 0}

    class _Counter:
        def add(self, category, op, n):
            bytes_["all_gather"] += n

    for m in [*model.blocks, model]:
        m.set_custom_all_gather(CountedAllGather(_Counter()))
        m.set_custom_reduce_scatter(_CountingReduceScatter(bytes_))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                            foreach=False)
    losses, per_step = [], []
    rows = cfg.batch_size // world
    for step in range(1, steps + 1):
        for g in opt.param_groups:
            g["lr"] = cfg.lr_at(step)
        x, y = get_batch(corpus, "train", step - 1, cfg.batch_size, cfg.model.block_size, cfg.seed)
        x, y = x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
        before = dict(bytes_)
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        per_step.append({k: bytes_[k] - before[k] for k in bytes_})
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    held = sum(local_data(p).numel() * local_data(p).element_size() for p in model.parameters())
    held += sum(local_data(p.grad).numel() * local_data(p.grad).element_size() for p in model.parameters()
                if p.grad is not None)
    held += sum(local_data(v).numel() * local_data(v).element_size() for st in opt.state.values()
                for v in st.values() if torch.is_tensor(v))
    if rank == 0:
        Path(out).write_text(json.dumps({"losses": losses, "bytes_per_step": per_step[-1],
                                         "bytes_per_param_rank0": held / n_params}))
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--backend", default="torch", help="the O3 run's FP8 backend (default torch)")
    ap.add_argument("--out", default=None, help="keep the O3 run directory here (default: a temporary one)")
    ap.add_argument("--rank-job", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_job:
        bf16_rank(args.steps, args.rank_job)
        return 0
    from fp8sim.training.distributed import train_distributed
    from fp8sim.training.run_dir import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        bf16_out = os.path.join(tmp, "bf16.json")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        __file__, "--steps", str(args.steps), "--rank-job", bf16_out], check=True, env=env)
        bf16 = json.loads(Path(bf16_out).read_text())
        run = Path(args.out) if args.out else Path(tmp) / "o3"
        summary = train_distributed(_cfg("fp8lm-o3", args.steps, args.backend), run, nproc=2, progress=False)
        rows = read_metrics(run)
    o3_loss = statistics.fmean(r["loss"] for r in rows[-10:])
    bf16_loss = statistics.fmean(bf16["losses"][-10:])
    comm = rows[-1]["comm_bytes"]
    result = {
        "steps": args.steps, "o3_backend": args.backend,
        "o3": {"loss_last10": o3_loss,
               "bytes_per_step": {"all_gather": comm["weights"], "reduce_scatter": comm["wgrad_fp8"] + comm["grads_other"],
                                  "scales": comm["scales"]},
               "bytes_per_param_rank0": summary["memory_bytes_per_param"]},
        "bf16_fsdp2": {"loss_last10": bf16_loss, "bytes_per_step": bf16["bytes_per_step"],
                       "bytes_per_param_rank0": bf16["bytes_per_param_rank0"]},
        "o3_over_bf16_loss": o3_loss / bf16_loss,
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

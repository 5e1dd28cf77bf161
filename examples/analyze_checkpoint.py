"""Analyze a checkpoint folder from Python: which tensors lose values in FP8, under which scaling.

    python examples/analyze_checkpoint.py [--hidden 64] [--out DIR] [--json FILE]

1. builds a small checkpoint: a tiny MLP's ``state_dict`` saved as ``model.safetensors`` (with a
   ``config.json``) in a folder (``--out``, else a temporary one). The second layer's rows are
   scaled from 1 down to 1e-7, as a layer whose rows live at very different magnitudes: one
   scale for the whole tensor cannot serve them all;
2. analyzes the folder with :func:`fp8sim.analysis.analyze` under E4M3 and E5M2, with one scale
   per tensor and one per row;
3. prints the result (a summary and its worst rows), then the worst tensor under each format x
   scaling (E4M3 needs a scale per row for it), and checks that the model's in-memory
   ``state_dict`` gives the same records as the folder.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from fp8sim.analysis import analyze


def build_checkpoint(folder: Path, hidden: int) -> torch.nn.Module:
    """A tiny MLP's weights in ``folder/model.safetensors``; returns the model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                torch.nn.Linear(4 * hidden, hidden))  # fmt: skip
    with torch.no_grad():  # rows from 1 down to 1e-7: 23 binades between the first and last
        model[2].weight.mul_(torch.logspace(0, -7, hidden).reshape(hidden, 1))
    folder.mkdir(parents=True, exist_ok=True)
    save_file(model.state_dict(), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "mlp", "hidden_size": hidden}))
    return model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--out", type=Path, help="the checkpoint folder (default: a temporary one)")
    ap.add_argument("--json", type=Path, help="also write the records as JSON (fp8sim analyze --json)")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.out or Path(tmp) / "checkpoint"
        model = build_checkpoint(folder, args.hidden)

        result = analyze(folder, formats="e4m3,e5m2", scalings="tensor,row")
        print(result)  # counts, then the worst records
        worst = result.worst(1)[0]
        print(f"\n{worst.name} under each format x scaling:")
        for r in result.records:
            if r.name == worst.name:
                print(f"  {r.format} {r.scaling:6}  {r.status:8}  underflow {r.underflow_pct:6.2f}%  "
                      f"subnormal {r.subnormal_pct:6.2f}%  SQNR {r.sqnr_db:5.1f} dB")
        if args.json:
            result.to_json(args.json)
            print(f"\nwrote {args.json}")

        # the same tensors in memory: the same records (the file name aside)
        in_memory = analyze(model.state_dict(), formats="e4m3,e5m2", scalings="tensor,row")
        same = [r.to_dict() | {"file": ""} for r in in_memory.records] == \
               [r.to_dict() | {"file": ""} for r in result.records]  # fmt: skip
        print(f"\nmodel.state_dict() in memory gives the same records: {same}")


if __name__ == "__main__":
    main()

"""examples/analyze_checkpoint.py and examples/replay_policies.py run at small size and print
what their docstrings promise."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_analyze_checkpoint_example(tmp_path, capsys):
    js = tmp_path / "records.json"
    _example("analyze_checkpoint").main(["--hidden", "16", "--out", str(tmp_path / "ck"), "--json", str(js)])
    out = capsys.readouterr().out
    # the second layer's rows span 1 .. 1e-7 (23 binades): more than E4M3 holds under one scale
    # (448 / 2**-9, ~18 binades), so values underflow; one scale per row keeps every row
    assert "2.weight under each format x scaling:" in out
    assert re.search(r"^  e4m3 tensor\s+critical\s+underflow\s+[1-9]\d\.\d\d%", out, re.M)
    assert re.search(r"^  e4m3 row\s+ok\s+underflow\s+0\.00%", out, re.M)
    assert "model.state_dict() in memory gives the same records: True" in out
    assert (tmp_path / "ck" / "model.safetensors").is_file()
    doc = json.loads(js.read_text())
    assert len(doc["records"]) == 4 * 2 * 2  # (2 weights, 2 biases) x (e4m3, e5m2) x (tensor, row)


def test_replay_policies_example(tmp_path, capsys):
    _example("replay_policies").main(["--steps", "12", "--spike", "8", "--out", str(tmp_path / "tr")])
    out = capsys.readouterr().out
    first = dict(re.findall(r"^  (\S+)\s+(act at step \d+|none)$", out, re.M))
    # current scaling maps each step's own amax to the format's max: it never overflows; a margin
    # of 2 binades (4x) absorbs every step but the 16x spike
    assert first["current:pow2=false,epsilon=0,margin=0,gran=tensor"] == "none"
    assert first["delayed:history=16,algo=max,margin=2"] == "act at step 8"
    worst = out.split("worst records")[1].splitlines()[1]
    assert "act step 8:" in worst and "an overflow event" in worst
    assert (tmp_path / "tr" / "trace.json").is_file()


def test_emulate_casts_example(capsys):
    """Its codes against ml_dtypes and a hand computation; a block scale beats one tensor scale
    on the rows an outlier does not share (the property the example shows)."""
    import ml_dtypes
    import numpy as np

    _example("emulate_casts").main(["--size", "256"])
    out = capsys.readouterr().out
    rne = int(np.float32(0.3).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    assert f"rne   code 0x{rne:02x} -> 0.3125" in out
    # 0.3 = 1.2 * 2**-2: the two e4m3 neighbours are 1.125 and 1.25 * 2**-2; toward zero: 1.125
    assert "rtz   code 0x29 -> 0.28125" in out and "up    code 0x2a -> 0.3125" in out
    assert "e4m3 saturate=True  code 0x7e -> 448.0" in out
    assert "e4m3 saturate=False code 0x7f -> nan" in out and "e5m2 saturate=False code 0x7c -> inf" in out
    rest = {m.group(1): float(m.group(2)) for m in re.finditer(r"^   \w+ (\S+)\s+whole tensor \S+; rows without "
                                                              r"the outlier (\S+)$", out, re.M)}  # fmt: skip
    assert set(rest) == {"tensor", "block:1x32", "nvfp4"}
    assert rest["block:1x32"] < rest["tensor"] / 2

"""examples/byom_llama.py runs at small size: convert, train, record, replay, verdict."""

import json
import os
import re
import subprocess
import sys

from fp8sim.trace import TraceReader

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def test_byom_llama_example_trains_records_and_replays(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "byom_llama.py"), "--steps", "3", "--seq", "16",
                        "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step    3  loss" in r.stderr
    reader = TraceReader(out / "trace")
    assert reader.steps().tolist() == [1, 2, 3]
    # 14 converted projections x (input, weight, grad_output, weight_grad), once per step
    assert len(reader.tensors) == 14 * 4 and len(reader.scalars()["step"]) == 3 * 14 * 4
    replay = json.loads((out / "replay.json").read_text())
    by = {p["policy"]: p for p in replay["policies"]}
    # te-delayed keeps weight gradients in high precision: their 3 x 14 records are what-if casts,
    # which replay leaves out by default (and says so)
    assert replay["what_if"]["records_left_out"] == 3 * 14 and not replay["what_if"]["replayed"]
    assert by["recorded"]["records"] == 3 * 14 * 3 and by["recorded"]["exact_pct"] == 100.0
    assert any(k.startswith("current:pow2=true") for k in by) and any(k.startswith("delayed:") for k in by)
    assert "replayed 126 records under 4 policies" in r.stderr + r.stdout
    # one verdict per converted projection x role the run casts (activation, weight, gradient;
    # what-if weight gradients judged only when asked), each in the format the trace records
    lines = r.stdout.split("per-layer verdict (layer, role, format: verdict)\n")[1].splitlines()
    assert len(lines) == 14 * 3
    recorded = {(t.name.rsplit(".", 1)[0], t.role): t.format for t in reader.tensors}
    verdict = re.compile(r"^  (\S+)  (\S+)  (e4m3|e5m2): (ok|needs margin \d+|needs finer scaling|keep in higher precision)")
    for line in lines:
        m = verdict.match(line)
        assert m, line
        assert recorded[m.group(1), m.group(2)] == m.group(3), line
    assert {m.group(3) for m in map(verdict.match, lines)} == {"e4m3", "e5m2"}  # E5M2 for gradients

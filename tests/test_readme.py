"""The README's tour runs exactly as written: every ```python block, then every ```sh block, in
order, in one fresh directory (the shell blocks read the trace the Python blocks wrote)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _blocks(lang: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def test_the_readme_has_a_tour():
    assert len(_blocks("python")) >= 2 and len(_blocks("sh")) >= 1


def test_the_tour_runs_as_written(tmp_path):
    bin_dir = os.path.dirname(sys.executable)  # the `fp8sim` console script lives beside python
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    for code in _blocks("python"):
        proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (code, proc.stderr[-3000:])
    first = subprocess.run([sys.executable, "-c", _blocks("python")[0]], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)
    # the values the comments promise
    assert " ".join(first.stdout.split()[:6]) == "[ 1.125 448. 448. -0. ]"
    for script in _blocks("sh"):
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode in (0,), (script, proc.stderr[-3000:])
        assert proc.stdout.strip(), script

"""The distribution installs one top-level package, ``fp8sim``, and never imports a foreign one.

The repository keeps ``kernels/``, ``analysis/`` and ``cli.py`` at its root; installed they are
``fp8sim.kernels``, ``fp8sim.analysis`` and ``fp8sim.cli``. ``kernels`` is also a real PyPI
package (Hugging Face's, pulled in by transformers), so a wheel that installed a top-level
``kernels`` would shadow it, or be shadowed.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOREIGN = ("kernels", "analysis", "cli")


def _python_files():
    for top in ("fp8sim", "kernels", "analysis", "tests", "benchmarks", "examples"):
        yield from (p for p in (ROOT / top).rglob("*.py") if p.is_file() and not p.is_symlink())
    yield ROOT / "cli.py"


def test_no_module_imports_a_top_level_kernels_analysis_or_cli():
    bad = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                    if n.split(".")[0] in FOREIGN]
    assert not bad, bad


def _can_build_without_isolation() -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    return int(setuptools.__version__.split(".")[0]) >= 70  # builds wheels without `wheel`


def _source_copy(dest: Path) -> Path:
    """The project's sources copied to ``dest`` (links kept as links), so that building the wheel
    leaves no build/ folder in the checkout."""
    skip = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__",
                                  ".numba_cache", ".hypothesis", ".pytest_cache", ".devrun")
    for name in ("pyproject.toml", "README.md", "LICENSE", "cli.py"):
        shutil.copy2(ROOT / name, dest / name)
    for top in ("fp8sim", "kernels", "analysis"):
        shutil.copytree(ROOT / top, dest / top, symlinks=True, ignore=skip)
    return dest


def test_the_wheel_has_one_top_level_name(tmp_path):
    src = _source_copy(tmp_path / "src" if (tmp_path / "src").mkdir() is None else tmp_path)
    out = tmp_path / "wheel"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)]
    if _can_build_without_isolation():
        cmd.insert(4, "--no-build-isolation")
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = out.glob("fp8sim-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"fp8sim"}, sorted(tops)
    for must in ("fp8sim/cli.py", "fp8sim/__main__.py", "fp8sim/kernels/quantize.py",
                 "fp8sim/analysis/api.py", "fp8sim/training/trainer.py"):
        assert must in names, must
    # the link fp8sim/cli.py -> ../cli.py is packed as the file itself
    assert zipfile.ZipFile(wheel).read("fp8sim/cli.py") == (ROOT / "cli.py").read_bytes()
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "fp8sim = fp8sim.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()

    # a regular (not editable) install of that wheel works on its own
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                           "--target", str(site), str(wheel)], capture_output=True, text=True,
                          timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_env = {**env, "PYTHONPATH": str(site), "TRITON_INTERPRET": "1"}
    code = ("import fp8sim, fp8sim.kernels.quantize, fp8sim.analysis.api, fp8sim.cli; "
            "print(fp8sim.__file__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=run_env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().startswith(str(site))  # the installed copy, not the checkout
    proc = subprocess.run([sys.executable, "-m", "fp8sim", "formats", "--json"], capture_output=True,
                          text=True, env=run_env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0 and '"e4m3"' in proc.stdout, proc.stderr[-2000:]


@pytest.fixture
def foreign_packages(tmp_path):
    """A folder holding unrelated top-level ``kernels``, ``analysis`` and ``cli`` that fail on import."""
    for name in ("kernels", "analysis"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('the foreign {name}')\n")
    (tmp_path / "cli.py").write_text("raise ImportError('the foreign cli')\n")
    return tmp_path


def test_foreign_top_level_packages_do_not_change_what_fp8sim_imports(foreign_packages):
    env = {**os.environ, "PYTHONPATH": str(foreign_packages), "TRITON_INTERPRET": "1"}
    code = ("import fp8sim.kernels.quantize, fp8sim.analysis.api, fp8sim.analysis.stats, "
            "fp8sim.backends.triton_backend; from fp8sim import cli; "
            "import sys; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            f"{FOREIGN!r}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=foreign_packages, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"
    proc = subprocess.run([sys.executable, "-m", "fp8sim", "formats", "--json"],
                          capture_output=True, text=True, env=env, cwd=foreign_packages,
                          timeout=300)
    assert proc.returncode == 0 and '"e4m3"' in proc.stdout, proc.stderr[-2000:]


def test_the_base_install_has_what_the_readme_tour_uses():
    """The Tour runs after 'pip install -e .': fp8sim.testing's draws need hypothesis, so it is a
    dependency, not only the test extra's."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {d.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip() for d in project["dependencies"]}
    assert {"hypothesis", "torch", "numpy", "numba", "safetensors", "matplotlib"} <= names

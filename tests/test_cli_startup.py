"""`fp8sim --help` and `fp8sim formats` start fast: they import neither torch nor numba (nor
Triton). Checked by what a fresh interpreter has imported, not by a timing."""

import subprocess
import sys

import pytest

HEAVY = ("torch", "numba", "triton")

PROBE = """
import sys, contextlib, io
from fp8sim import cli
with contextlib.redirect_stdout(io.StringIO()):
    rc = cli.main({argv!r})
print(rc, sorted(m for m in {heavy!r} if m in sys.modules))
"""


@pytest.mark.parametrize("argv", [["formats"], ["formats", "--json"], ["formats", "e4m3"]])
def test_light_commands_import_neither_torch_nor_numba(argv):
    out = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv, heavy=HEAVY)], capture_output=True,
                         text=True, timeout=120, cwd="/")  # fmt: skip
    rc, imported = out.stdout.split(" ", 1)
    assert imported.strip() == "[]", (argv, imported, out.stderr)
    assert rc == "0", out.stderr


def test_help_imports_neither_torch_nor_numba():
    code = (
        "import sys, contextlib, io\nfrom fp8sim import cli\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try: cli.main(['--help'])\n    except SystemExit as e: assert e.code == 0\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.stdout.strip() == "[]", out.stderr


def test_the_lazy_package_attributes_resolve():
    import fp8sim
    import fp8sim.training

    assert fp8sim.encode is fp8sim.emulator.encode
    assert set(fp8sim.__all__) <= set(dir(fp8sim))
    for name in fp8sim.training.__all__:
        assert getattr(fp8sim.training, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        fp8sim.nope


def test_every_option_of_every_command_says_what_it_does_and_its_default():
    import argparse

    from fp8sim import cli

    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, p in sub.choices.items():
        for a in p._actions:
            if isinstance(a, argparse._HelpAction) or a.help is argparse.SUPPRESS:
                continue
            assert a.help, (name, a.option_strings or a.dest)
            if a.option_strings and a.default not in (None, False):  # a real default: shown
                assert "default" in a.help, (name, a.option_strings, a.default)

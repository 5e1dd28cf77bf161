"""fp8sim command line: ``fp8sim <command> ...``.

Thin by design: each subcommand lives in its own module exposing ``register(subparsers)`` (adds
its parser and sets ``func``) and the ``func(args) -> int`` it points to. This file only wires them,
turns known errors into one line on stderr with exit code 2, and never prints a traceback unless
``FP8SIM_DEBUG=1``.

Exit codes: 0 ok, 1 a gate the user asked for failed (a ``--fail-on`` rule crossed, ``conformance
--fail-on-disagreement``), 2 bad input or usage, 3 an internal error (a bug), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from fp8sim.errors import one_line

__all__ = ["main", "build_parser", "COMMAND_MODULES"]

#: one module per subcommand group, in the order `fp8sim --help` lists them
COMMAND_MODULES = [
    "fp8sim.commands.formats",  # formats
    "fp8sim.commands.cast",  # cast
    "fp8sim.commands.conformance",  # conformance
    "fp8sim.commands.policies",  # policies
    "fp8sim.commands.train",  # train, compare
    "fp8sim.commands.analyze",  # analyze, replay
    "fp8sim.commands.merge",  # merge
    "fp8sim.commands.demo",  # demo
]


class UsageError(Exception):
    """Bad input from the user: reported as one line, exit code 2."""


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (what, and where to look) + exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _version() -> str:
    """The installed distribution's version (the package's own when not installed)."""
    from importlib import metadata

    try:
        return metadata.version("fp8sim")
    except metadata.PackageNotFoundError:
        from fp8sim import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="fp8sim",
        description="Bit-exact FP8 emulation, analysis, policy replay and FP8 training.",
    )
    parser.add_argument("--version", action="version", version=f"fp8sim {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:  # the commands' modules import torch here: a second or so where Ctrl-C can land
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
    except KeyboardInterrupt:
        print("fp8sim: interrupted", file=sys.stderr)
        return 130
    if extra:  # paths after an option (``analyze a.npy --keep-going b.npy``) are still paths
        if args.command == "analyze" and not any(e.startswith("-") for e in extra):
            args.paths.extend(extra)
        else:
            print(f"fp8sim {args.command}: error: unrecognized arguments: {' '.join(extra)} "
                  f"(see 'fp8sim {args.command} --help')", file=sys.stderr)  # fmt: skip
            return 2
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # the reader went away (``| head``): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
        return 0
    except (ValueError, TypeError, ArithmeticError, OSError, NotImplementedError,
            UsageError) as exc:
        _traceback_if_debug()
        msg = one_line(str(exc)) or type(exc).__name__
        print(f"fp8sim {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fp8sim {args.command}: interrupted", file=sys.stderr)
        return 130
    except MemoryError as exc:  # numpy's "Unable to allocate ...", or a bare one
        print(f"fp8sim {args.command}: error: out of memory ({one_line(str(exc)) or 'MemoryError'})",
              file=sys.stderr)  # fmt: skip
        return 2
    except Exception as exc:  # a bug, not bad input: its own exit code (1 means --fail-on)
        if _interrupted(exc):  # Ctrl-C inside a numba function surfaces as a SystemError
            print(f"fp8sim {args.command}: interrupted", file=sys.stderr)
            return 130
        _traceback_if_debug()
        msg = one_line(str(exc))
        if isinstance(exc, RuntimeError) and "can't allocate memory" in msg:  # torch's allocator
            print(f"fp8sim {args.command}: error: out of memory ({msg})", file=sys.stderr)
            return 2
        print(f"fp8sim {args.command}: internal error: {type(exc).__name__}: {msg} (a bug; "
              "FP8SIM_DEBUG=1 shows the traceback)", file=sys.stderr)  # fmt: skip
        return 3


def _traceback_if_debug() -> None:
    """With ``FP8SIM_DEBUG=1``, the traceback of the exception being handled on stderr; the
    exit code stays the one the error has (2 bad input, 3 a bug), never Python's 1, which means a
    crossed ``--fail-on`` threshold."""
    if os.environ.get("FP8SIM_DEBUG") == "1":
        import traceback

        traceback.print_exc()


def _interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` wraps a KeyboardInterrupt (its cause or context chain)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


if __name__ == "__main__":
    sys.exit(main())

"""Errors of library calls that the command line reports in its own words.

A library function names its *parameters* when an argument is bad (``margin: ...``,
``fail_on rule 'x>1': ...``); the command that called it names its *flags* (``--margin: ...``).
:class:`ArgumentError` carries the message with the parameter names marked, so the command can
say the same sentence with its flags (:meth:`ArgumentError.spelled`, :func:`spelled_as`). It is a
``ValueError``: like every other bad input, it is one line and exit code 2 on the command line.

The ``expect_*`` functions check one argument's type and range and return it, or raise
:class:`ArgumentError` naming it (``pow2 must be True or False, got 'no'``): a library call
never takes ``"no"`` for a flag or 1.5 for a count silently, nor fails later with an
AttributeError of its own.
"""

from __future__ import annotations

import math
import numbers
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

__all__ = ["ArgumentError", "spelled_as", "expect_bool", "expect_int", "expect_real", "expect_str", "expect_names",
           "one_line"]


class ArgumentError(ValueError):
    """A bad argument value. ``parts`` alternate text and parameter names: ``parts[1]``,
    ``parts[3]``, ... are names, the others text (``ArgumentError("", "top", " must be >= 0")``
    reads ``top must be >= 0``)."""

    def __init__(self, *parts: str):
        self.parts = tuple(str(p) for p in parts)
        super().__init__("".join(self.parts))

    @classmethod
    def about(cls, name: str, rest: str) -> "ArgumentError":
        """The common case: a message that starts with the parameter's name."""
        return cls("", name, rest)

    @classmethod
    def renamed(cls, exc: BaseException, prefix: str, name: str) -> "ArgumentError":
        """``exc``'s message, which starts with ``prefix`` (a helper's own word for the
        argument, e.g. ``--fail-on``), naming ``name`` instead; a message that does not start
        with ``prefix`` is kept whole, naming nothing."""
        text = str(exc)
        if not text.startswith(prefix):
            return cls(text)
        return cls("", name, text[len(prefix):])

    @property
    def arguments(self) -> tuple[str, ...]:
        """The parameter names the message mentions, in order."""
        return self.parts[1::2]

    def spelled(self, names: Mapping[str, str]) -> str:
        """The message with each parameter name replaced by ``names[name]`` (where given)."""
        return "".join(names.get(p, p) if i % 2 else p for i, p in enumerate(self.parts))


@contextmanager
def spelled_as(names: Mapping[str, str]) -> Iterator[None]:
    """Inside the block, an :class:`ArgumentError` becomes a ``ValueError`` whose message names
    ``names[parameter]`` (a command's flags) instead of the parameters."""
    try:
        yield
    except ArgumentError as exc:
        raise ValueError(exc.spelled(names)) from None


def _got(value: Any) -> str:
    return f"got {value!r:.60}" if isinstance(value, (str, int, float)) else f"got a {type(value).__name__}"


def expect_bool(value: Any, name: str) -> bool:
    """``value`` if it is True or False (not 1, not ``"no"``), else :class:`ArgumentError`."""
    if not isinstance(value, bool):
        raise ArgumentError.about(name, f" must be True or False, {_got(value)}")
    return value


def expect_int(value: Any, name: str, *, lowest: int, optional: bool = False) -> int | None:
    """``value`` as an int if it is an integer (a Python or numpy one; not a bool, not 1.5)
    >= ``lowest`` (or None where ``optional``), else :class:`ArgumentError`."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lowest:
        raise ArgumentError.about(name, f" must be an integer >= {lowest}, {_got(value)}")
    return int(value)


def expect_real(value: Any, name: str, *, finite: bool = True) -> float:
    """``value`` as a float if it is a real number (a Python or numpy int or float, not a bool
    or a string; finite unless ``finite=False``), else :class:`ArgumentError`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or (finite and not math.isfinite(value)):
        raise ArgumentError.about(name, f" must be a {'finite ' if finite else ''}number, {_got(value)}")
    return float(value)


def expect_str(value: Any, name: str, *, optional: bool = False) -> str | None:
    """``value`` if it is a string (or None where ``optional``), else :class:`ArgumentError`."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise ArgumentError.about(name, f" must be a string, {_got(value)}")
    return value


def expect_names(value: Any, name: str) -> str | Sequence[str]:
    """``value`` if it is a string or a list/tuple of strings (``"e4m3,e5m2"``, ``["e4m3"]``),
    else :class:`ArgumentError`."""
    if isinstance(value, str) or (isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)):
        return value
    raise ArgumentError.about(name, f" must be a string or a list of strings, {_got(value)}")


#: a message longer than this, over several lines, is cut to its first line
_ONE_LINE_MAX = 400


def one_line(text: str) -> str:
    """An error message as one line: a short message over several lines (a file name with a
    newline in it, say) keeps every part, its line breaks written ``\\n``; a long one (a
    library's explanation) keeps its first line."""
    text = text.strip()
    if "\n" not in text and "\r" not in text:
        return text
    if len(text) <= _ONE_LINE_MAX:
        return text.replace("\r", "\\r").replace("\n", "\\n")
    return text.splitlines()[0]

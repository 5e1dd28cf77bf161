"""Errors of library calls that the command line reports in its own words.

A library function names its *parameters* when an argument is bad (``margin: ...``,
``fail_on rule 'x>1': ...``); the command that called it names its *flags* (``--margin: ...``).
:class:`ArgumentError` carries the message with the parameter names marked, so the command can
say the same sentence with its flags (:meth:`ArgumentError.spelled`, :func:`spelled_as`). It is a
``ValueError``: like every other bad input, it is one line and exit code 2 on the command line.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Mapping

__all__ = ["ArgumentError", "spelled_as"]


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

"""Package attributes imported on first use (PEP 562): ``import fp8sim`` -- and ``fp8sim --help``
-- loads neither numba nor torch until a name that needs them is used."""

from __future__ import annotations

import importlib
from typing import Any, Callable

__all__ = ["lazy_attributes"]


def lazy_attributes(package: str, exports: dict[str, str], namespace: dict[str, Any]
                    ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: ``exports`` maps each public name to
    the module that defines it; a name is imported once, then kept in ``namespace`` (the
    package's ``globals()``)."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
            namespace[name] = value  # later lookups do not come here
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__

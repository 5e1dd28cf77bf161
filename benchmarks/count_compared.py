"""How many values each test compares: a pytest plugin, and a report of two runs side by side.

A refactor of the numerics must not quietly test less. This plugin counts, per test, the
elements passed through the comparison functions the tests use (numpy.testing's
``assert_array_equal`` / ``assert_equal`` / ``assert_allclose`` / ``assert_array_almost_equal``,
``np.array_equal``, ``torch.equal``, ``torch.testing.assert_close``; the larger operand's size
per call) and writes ``{test id: values}`` as JSON. Comparisons written as ``assert (a == b).all()``
are not seen: the counts are a floor, the same floor before and after.

    python -m pytest -p benchmarks.count_compared --count-compared before.json tests/test_emulator.py ...
    python benchmarks/count_compared.py before.json after.json     # per module, and tests that fell

Run it without xdist (``-p no:xdist`` or ``-n 0``): each worker would write its own file.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

_counts: dict[str, int] = defaultdict(int)
_current: list[str] = [""]


def _size(x) -> int:
    try:
        import numpy as np

        if hasattr(x, "numel"):
            return int(x.numel())
        return int(np.size(x))
    except Exception:  # anything numpy cannot size counts once
        return 1


def _wrap(fn):
    def counted(a, b, *args, **kwargs):
        _counts[_current[0]] += max(_size(a), _size(b))
        return fn(a, b, *args, **kwargs)

    counted.__wrapped__ = fn
    return counted


def _install() -> None:
    import numpy as np
    import numpy.testing as npt

    for name in ("assert_array_equal", "assert_equal", "assert_allclose", "assert_array_almost_equal"):
        setattr(npt, name, _wrap(getattr(npt, name)))
    np.array_equal = _wrap(np.array_equal)
    try:
        import torch
        import torch.testing

        torch.equal = _wrap(torch.equal)
        torch.testing.assert_close = _wrap(torch.testing.assert_close)
    except ImportError:
        pass


def pytest_addoption(parser):
    parser.addoption("--count-compared", metavar="JSON", help="write {test id: values compared} to JSON")


def pytest_configure(config):
    if config.getoption("--count-compared"):
        _install()  # before the test modules are imported, so their `from ... import` see the wrappers


def pytest_runtest_setup(item):
    _current[0] = item.nodeid


def pytest_sessionfinish(session):
    path = session.config.getoption("--count-compared")
    if path:
        with open(path, "w") as f:
            json.dump(dict(sorted(_counts.items())), f, indent=0)


def _report(before_path: str, after_path: str) -> int:
    before, after = (json.load(open(p)) for p in (before_path, after_path))
    per_mod: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for k, v in before.items():
        per_mod[k.split("::")[0]][0] += v
    for k, v in after.items():
        per_mod[k.split("::")[0]][1] += v
    print("| test module | values compared before | after |")
    print("| --- | ---: | ---: |")
    for mod, (b, a) in sorted(per_mod.items()):
        print(f"| {mod} | {b:,} | {a:,} |")
    tb, ta = sum(before.values()), sum(after.values())
    print(f"| **total** | **{tb:,}** | **{ta:,}** |")
    fell = [(k, v, after.get(k, 0)) for k, v in before.items() if after.get(k, 0) < v]
    for k, b, a in fell:
        print(f"fell: {k}: {b:,} -> {a:,}")
    return 1 if fell else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python benchmarks/count_compared.py BEFORE.json AFTER.json")
    sys.exit(_report(sys.argv[1], sys.argv[2]))

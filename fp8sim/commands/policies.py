"""``fp8sim policies``: list the scaling policy specs, their parameters and defaults.

``fp8sim policies`` prints every policy; ``fp8sim policies SPEC`` parses one spec (e.g.
``delayed:history=16,margin=1``) and prints its canonical form with every parameter spelled out,
or fails with exit code 2 naming the valid keys. ``--json`` prints the same as JSON on stdout.
"""

from __future__ import annotations

import argparse
import sys

from fp8sim.commands.output import print_json

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "policies",
        help="list scaling policies (specs, parameters, defaults)",
        description="List the scaling policy specs accepted by --policy options, with their "
        "parameters and defaults; or check one SPEC and print its canonical form.",
    )
    p.add_argument(
        "spec", nargs="?", help="a policy spec to check, e.g. 'delayed:history=16,margin=1'"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fp8sim.policies import POLICY_SPECS, format_param, parse_policy  # numba: only when run

    if args.spec is not None:
        policy = parse_policy(args.spec)  # ValueError -> one line, exit 2 (cli.main)
        info = {
            "spec": policy.spec,
            "name": policy.NAME,
            "params": dict(policy.params),
            "just_in_time": bool(policy.just_in_time),
            "granularity": policy.granularity,
        }
        if args.json:
            print_json(info)
        else:
            print(info["spec"])
            print(
                f"  just in time: {'yes' if info['just_in_time'] else 'no'}; "
                f"granularity: {info['granularity']}"
            )
        return 0
    if args.json:
        print_json(POLICY_SPECS)
        return 0
    for name, spec in POLICY_SPECS.items():
        print(f"{name}: {spec['description']}")
        for key, p in spec["params"].items():
            choices = f" (one of {', '.join(p['choices'])})" if p["choices"] else ""
            print(f"  {key}={format_param(p['default'])}  {p['help']}{choices}")
    print(
        "\nspec syntax: NAME or NAME:key=value,key=value; a bare flag or choice also works "
        "(current:pow2, mx:rceil, delayed:most_recent)",
        file=sys.stderr,
    )
    return 0

"""Subcommand modules of the ``fp8sim`` command line (see cli.py)."""

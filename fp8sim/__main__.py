"""``python -m fp8sim``: the ``fp8sim`` command."""

import sys

from fp8sim.cli import main

sys.exit(main())

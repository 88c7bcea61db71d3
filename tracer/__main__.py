"""``python -m tracer``: the command line, whose code lives in the top layer (analysis/cli.py).

This entry point is the one module of ``tracer`` that reaches up: it is the program, and nothing imports it.
"""

import sys

from analysis.cli import main

sys.exit(main())

"""``python -m tracer``: the command line, whose code lives in the top layer (analysis/cli.py).

This entry point is the one module of ``tracer`` that reaches up: it is the program, and nothing imports it.
"""

import os
import sys

from analysis.cli import main

code = main()
# Tearing down an interpreter that holds torch and transformers takes about a second, and the program has
# nothing left to release: every file it writes is closed. Flush what it printed and leave.
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)

"""python -m hetero.trainer: one training run (hetero/trainer/run.py)."""
import os
import sys

from .run import main

code = main()
sys.stdout.flush()
sys.stderr.flush()
# Skip interpreter finalisation: a communication thread still being torn down there can abort the process
# ("terminate called without an active exception") after all work is done and the group destroyed.
os._exit(code)

"""`python -m attention_core.plan`, will it fit: tokens and per-call memory of a video model's attention and
feed-forward. The command lives in attention_core/cli/plan.py; this module keeps the name users call. Imported, it is
that module itself (sys.modules), so `from attention_core.plan import X` and monkeypatching reach the one module."""
import sys

from .cli import plan as _command
from .cli.plan import main

if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__] = _command

"""`python -m attention_core.tune`, per-device tile profiles. The command lives in attention_core/cli/tune.py; this
module keeps the name users call. Imported, it is that module itself (sys.modules), so `from attention_core.tune
import X` and monkeypatching reach the one module."""
import sys

from .cli import tune as _command
from .cli.tune import main

if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__] = _command

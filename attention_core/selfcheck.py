"""`python -m attention_core.selfcheck`, every tier against torch's math SDPA in float64 on this device. The command
lives in attention_core/cli/selfcheck.py; this module keeps the name users call. Imported, it is that module
itself (sys.modules), so `from attention_core.selfcheck import X` and monkeypatching reach the one module."""
import sys

from .cli import selfcheck as _command
from .cli.selfcheck import main

if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__] = _command

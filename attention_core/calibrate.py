"""`python -m attention_core.calibrate`, device calibration, the measured throughput the time estimate reads. The
command lives in attention_core/cli/calibrate.py; this module keeps the name users call. Imported, it is that
module itself (sys.modules), so `from attention_core.calibrate import X` and monkeypatching reach the one module."""
import sys

from .cli import calibrate as _command
from .cli.calibrate import main

if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__] = _command

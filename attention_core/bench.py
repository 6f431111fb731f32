"""`python -m attention_core.bench`, the benchmark: time, peak extra memory and error per attention method, and its
model presets. The command lives in attention_core/cli/bench.py; this module keeps the name users call. Imported,
it is that module itself (sys.modules), so `from attention_core.bench import X` and monkeypatching reach the one
module."""
import sys

from .cli import bench as _command
from .cli.bench import main

if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__] = _command

"""attention_core.estimate (documented path, kept): the time-per-step estimate, step_time and the rest, which lives
in attention_core/cli/estimate.py with the commands that show it. Imported, this name is that module itself
(sys.modules), so `from attention_core.estimate import step_time` and monkeypatching reach the one module."""
import sys

from .cli import estimate as _module

sys.modules[__name__] = _module

"""`python -m attention_core.report`, one Markdown file about this GPU to paste into an issue. The command lives in
attention_core/cli/report.py; this module keeps the name users call. Imported, it is that module itself
(sys.modules), so `from attention_core.report import X` and monkeypatching reach the one module."""
import sys

from .cli import report as _command
from .cli.report import main

if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__] = _command

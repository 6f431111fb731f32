"""pytest plugin for `./dev mutate`: which test executes which line (coverage.py, one context per test node id).

Copied next to the tree as mutate_coverage_plugin.py and loaded with `-p mutate_coverage_plugin` on the unmutated copy
(measuring from its import, before any conftest.py); writes the coverage data file named by
MUTATE_COVERAGE_FILE. Lines run while no test is running (imports) get the empty context.
"""
import os

import coverage

_cov = None


def _start():
    """Measure from the moment `-p` imports this plugin: before pytest loads any conftest.py, so the import-time
    lines (constants) of modules a conftest imports get the empty context, not no context at all."""
    global _cov
    path = os.environ.get("MUTATE_COVERAGE_FILE")
    if not path or _cov is not None:
        return
    _cov = coverage.Coverage(data_file=path, include=[os.path.join(os.environ["MUTATE_TREE"], "*")],
                             config_file=False)
    _cov.start()


_start()


def pytest_runtest_setup(item):
    if _cov is not None:
        _cov.switch_context(item.nodeid)


def pytest_runtest_logfinish(nodeid, location):
    if _cov is not None:
        _cov.switch_context("")


def pytest_unconfigure(config):
    global _cov
    if _cov is not None:
        _cov.stop()
        _cov.save()
        _cov = None

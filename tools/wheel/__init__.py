"""The engine as a wheel, kept so: check.py builds it from a clean clone, twine-checks it, installs it beside each
torch and runs the integrations' tests from the installed copy (python -m tools.wheel.check --help)."""

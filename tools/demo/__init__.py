"""The demo (`./dev demo`): Wan 2.2 / LTX-2.3 workflows run with and without the pack, its summary and charts, and
the README screenshot (`python -m tools.demo.screenshot`), with the headless-Chromium page helpers they share with
tests/browser."""

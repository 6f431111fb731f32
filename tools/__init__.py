"""Tools that are neither nodes nor tests, grouped by who uses them (see docs/development.md, "Where things are"):
workflow_api.py (the user's workflow UI -> API converter), demo/, comfyui_setup/, fixtures/, mutation/, measure/,
wheel/ (CI's check of the engine's wheel).
Never imported by the pack itself (ComfyUI loads only the root package, `nodes/` and `attention_core/`)."""

"""Tools that are neither nodes nor tests: the workflow UI -> API converter, the demo, a real ComfyUI server in a
subprocess, the test ComfyUI installations, and writers of random-weight model files of the real architectures.
Never imported by the pack itself (ComfyUI loads only the root package, `nodes/` and `attention_core/`)."""

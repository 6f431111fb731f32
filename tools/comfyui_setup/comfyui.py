"""The ComfyUI installations the tests and the demo run: the stock 0.3.75 and 0.33.0 that `./dev` sets up under
`.cache/`, or the user's own checkouts named by environment variables.

    COMFYUI_PATH          replaces the stock 0.3.75
    COMFYUI_LATEST_PATH   replaces the stock 0.33.0 (the newest, with the LTX-2.3 model code)

`import_comfy(version)` imports one of them into this process in CPU mode (a process can hold one ComfyUI)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/<group>/x.py
OLDEST, LATEST = "0.3.75", "0.33.0"
VERSIONS = (OLDEST, LATEST)
ENV_VARS = {OLDEST: "COMFYUI_PATH", LATEST: "COMFYUI_LATEST_PATH"}
# 0.3.75 shares the test venv with 0.33.0, whose pip requirements pin a newer frontend: ./dev unpacks the one
# 0.3.75 pins (comfyui-frontend-package 1.32.9) here and the server is started with --front-end-root on it.
FRONTENDS = {OLDEST: os.path.join(ROOT, ".cache", "frontend-1.32.9")}
INPROCESS_ENV = "TILED_ATTENTION_TEST_COMFYUI"  # which version an in-process test session imports
# the project's shared/ folder (stock ComfyUI sources, saved /object_info): ../shared, or $TILED_ATTENTION_SHARED
# when the checkout lives elsewhere (CI runs it from <tmp>/ComfyUI/custom_nodes/tiled-attention)
SHARED = os.environ.get("TILED_ATTENTION_SHARED") or os.path.join(os.path.dirname(ROOT), "shared")


def comfy_path(version=LATEST):
    """The folder of that ComfyUI version, or None when it is not set up."""
    if version not in VERSIONS:
        raise ValueError(f"unknown ComfyUI version {version!r}; known: {', '.join(VERSIONS)}")
    path = os.environ.get(ENV_VARS[version]) or os.path.join(ROOT, ".cache", f"comfyui-{version}")
    return path if os.path.isfile(os.path.join(path, "comfy", "model_management.py")) else None


def comfy_version(path):
    """The version string a ComfyUI folder declares (comfyui_version.py)."""
    with open(os.path.join(path, "comfyui_version.py")) as f:
        for line in f:
            if line.startswith("__version__"):
                return line.split("=", 1)[1].strip().strip("\"'")
    return "unknown"


def inprocess_version():
    """The version that in-process code (tests, tiny-model writers) imports: $TILED_ATTENTION_TEST_COMFYUI, else
    the newest."""
    return os.environ.get(INPROCESS_ENV) or LATEST


def imported_path():
    """The folder of the ComfyUI already imported into this process, or None."""
    mm = sys.modules.get("comfy.model_management")
    return os.path.dirname(os.path.dirname(os.path.abspath(mm.__file__))) if mm else None


def import_comfy(version=None):
    """Import that ComfyUI into this process in CPU mode, once; returns its folder. Raises RuntimeError when it
    is not set up or another ComfyUI is already imported."""
    version = version or inprocess_version()
    path = comfy_path(version)
    if path is None:
        raise RuntimeError(f"ComfyUI {version} is not set up: run ./dev setup, or set {ENV_VARS[version]} to a "
                           "ComfyUI checkout")
    already = imported_path()
    if already is not None:
        if os.path.realpath(already) != os.path.realpath(path):
            raise RuntimeError(f"this process already imported the ComfyUI at {already}; cannot also import {path}")
        return path
    if path not in sys.path:
        sys.path.insert(0, path)
    import comfy.options  # noqa: F401 - argument parsing stays off: defaults
    from comfy.cli_args import args
    args.cpu = True  # before comfy.model_management is imported
    import utils.install_util  # noqa: F401 - ComfyUI's top-level `utils` package, before `nodes` shadows it
    import comfy.model_management  # noqa: F401
    return path

"""A real ComfyUI for the tests: the stock 0.3.75 that ./dev fetches (or COMFYUI_PATH), imported in CPU mode,
and this pack loaded the way ComfyUI loads a custom node folder (a package under its own name)."""
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACK_NAME = "tiled_attention_pack"


def comfy_path():
    path = os.environ.get("COMFYUI_PATH") or os.path.join(ROOT, ".cache", "comfyui-0.3.75")
    return path if os.path.isfile(os.path.join(path, "comfy", "model_management.py")) else None


def require_comfy():
    """Import ComfyUI (CPU mode) once; skip the test when no ComfyUI was set up."""
    path = comfy_path()
    if path is None:
        pytest.skip("no ComfyUI: run the suite with ./dev test (it fetches the stock ComfyUI 0.3.75) or set "
                    "COMFYUI_PATH")
    if path not in sys.path:
        sys.path.insert(0, path)
    import comfy.options  # noqa: F401 - argument parsing stays off: defaults
    from comfy.cli_args import args
    args.cpu = True  # before comfy.model_management is imported
    import utils.install_util  # noqa: F401 - ComfyUI's top-level `utils` package, before `nodes` shadows it
    import comfy.model_management
    return path


def load_pack():
    """This repository as ComfyUI imports a custom node folder: a package with its own name."""
    require_comfy()
    if PACK_NAME in sys.modules:
        return sys.modules[PACK_NAME]
    spec = importlib.util.spec_from_file_location(PACK_NAME, os.path.join(ROOT, "__init__.py"),
                                                  submodule_search_locations=[ROOT])
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACK_NAME] = module
    spec.loader.exec_module(module)
    return module


def comfy_nodes():
    require_comfy()
    import nodes
    return nodes

"""A real ComfyUI inside the test process (one version per process: tools.comfyui_setup.comfyui.inprocess_version()),
and this pack loaded the way ComfyUI loads a custom node folder (a package under its own name)."""
import importlib.util
import os
import sys

import pytest

from tools.comfyui_setup.comfyui import ROOT, comfy_path, import_comfy, inprocess_version

PACK_NAME = "tiled_attention_pack"


def missing(what):
    """Skip for a missing tool, server or file. Under CI=true tests/conftest.py turns such a skip into a failure:
    CI must run it all."""
    pytest.skip(what)


def require_comfy(version=None):
    """Import ComfyUI (CPU mode) once; skip (fail under CI) when it was not set up."""
    version = version or inprocess_version()
    if os.environ.get("TILED_ATTENTION_NO_COMFYUI"):  # set by ./dev test-oldest-torch: the engine's env alone
        pytest.skip("not applicable: the oldest-torch environment (./dev test-oldest-torch) has the engine alone; "
                    "this test runs with ComfyUI in ./dev test")
    if comfy_path(version) is None:
        missing(f"no ComfyUI {version}: run the suite with ./dev test (it sets up the stock ComfyUIs)")
    return import_comfy(version)


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


def load_tiny(tmp_path_factory, writer, name, model_config, inference=False):
    """A tiny model file written by `writer` (tools.fixtures.tiny_models), loaded by ComfyUI's own loader and checked to
    be detected as `model_config`; inference=True loads it under torch.inference_mode, as ComfyUI's executor runs every
    node (its weights are then inference tensors)."""
    import contextlib
    import torch
    import comfy.sd
    path = writer(str(tmp_path_factory.mktemp("models") / name))
    with torch.inference_mode() if inference else contextlib.nullcontext():
        model = comfy.sd.load_diffusion_model(path)
    assert type(model.model.model_config).__name__ == model_config
    return model


def comfy_nodes():
    require_comfy()
    import nodes
    return nodes

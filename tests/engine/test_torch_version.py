"""The oldest torch the engine runs on (2.5): code only newer torch accepts must not come back, and an older torch
gets one clear line. (The whole engine suite also runs on torch 2.5.1: ./dev test-oldest-torch, in CI.)"""
import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest

import attention_core
from attention_core.device.torch_version import MIN_TORCH, TorchTooOld, parse, require_torch

ROOT = pathlib.Path(attention_core.__file__).parent.parent


def test_custom_op_modules_have_real_annotations():
    """torch < 2.7's infer_schema cannot resolve string annotations ('Tuple[Tensor, Tensor]'): a module that
    defines a torch.library.custom_op must not use `from __future__ import annotations` (import failed on 2.5)."""
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        if any(part.startswith(".") for part in path.relative_to(ROOT).parts):
            continue
        text = path.read_text()
        if "custom_op" not in text:
            continue
        tree = ast.parse(text)
        if any(isinstance(n, ast.ImportFrom) and n.module == "__future__" and
               any(a.name == "annotations" for a in n.names) for n in tree.body):
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"custom ops under 'from __future__ import annotations' (breaks torch 2.5/2.6): {offenders}"


@pytest.mark.parametrize("version, ok", [("2.5.1", True), ("2.5.0a0+gitabc", True), ("2.14.1+cpu", True),
                                         ("3.0.0", True), ("2.4.1+rocm6.1", False), ("1.13.1", False)])
def test_require_torch(version, ok):
    assert parse(version) >= MIN_TORCH if ok else parse(version) < MIN_TORCH
    if ok:
        require_torch(version)
    else:
        with pytest.raises(TorchTooOld, match=rf"needs torch >= 2\.5 \(found {re.escape(version)}\)"):
            require_torch(version)


LOAD_UNDER_OLD_TORCH = r"""
import importlib.util, logging, sys, torch
torch.__version__ = "2.4.1+rocm6.1"   # what torch 2.4 reports; everything else about this torch is unchanged
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stdout)
root = sys.argv[1]
spec = importlib.util.spec_from_file_location("tiled_attention_pack", root + "/__init__.py",
                                              submodule_search_locations=[root])
module = importlib.util.module_from_spec(spec)
sys.modules["tiled_attention_pack"] = module
spec.loader.exec_module(module)       # as ComfyUI's loader imports a custom node folder
print("NODES", module.NODE_CLASS_MAPPINGS, hasattr(module, "comfy_entrypoint"))
"""


def test_pack_under_too_old_torch_logs_one_line_and_lists_no_nodes():
    """The ComfyUI entry point under torch 2.4: no exception (ComfyUI goes on loading other packs), one log line
    naming the torch needed, an empty NODE_CLASS_MAPPINGS (ComfyUI then loads the folder without complaint)."""
    env = dict(os.environ, PYTHONPATH="")
    res = subprocess.run([sys.executable, "-c", LOAD_UNDER_OLD_TORCH, str(ROOT)], capture_output=True, text=True,
                         timeout=300, env=env, cwd=str(ROOT.parent))
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if "tiled-attention" in ln or "tiled attention" in ln]
    assert len(lines) == 1, res.stdout
    assert lines[0].startswith("ERROR [tiled-attention] not loaded: tiled attention needs torch >= 2.5 (found "
                               "2.4.1+rocm6.1)"), lines
    assert "NODES {} False" in res.stdout

"""The engine's custom ops are tiled_attention::fwd / ::bwd whatever the package is named (issue 30, item 12): ComfyUI
imports the pack's copy under a module name made from its install path (`<path, '.' as '_x_'>.attention_core`),
which used to become the op namespace (`tiled_attention_<path, mangled>_attention_core::fwd`). The first copy in a
process takes `tiled_attention`, a second `tiled_attention_2`, a third `tiled_attention_3`: no path in any name, no
collision. Run in a fresh interpreter: which copy comes first is the point."""
import os
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "attention_core"

CODE = f"""
import importlib.util, sys, types, torch

def load_copy(parent):
    sys.modules[parent] = types.ModuleType(parent)
    sys.modules[parent].__path__ = []
    spec = importlib.util.spec_from_file_location(parent + ".attention_core", {str(PKG / "__init__.py")!r},
                                                  submodule_search_locations=[{str(PKG)!r}])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod

comfy = load_copy("/opt/ComfyUI/custom_nodes/tiled-attention")  # as ComfyUI 0.33 names a custom node folder
import attention_core
third = load_copy("other_pack")
names = [m.kernel.autograd.NS for m in (comfy, attention_core, third)]
print(names)
assert names == ["tiled_attention", "tiled_attention_2", "tiled_attention_3"], names
assert torch.ops.tiled_attention.fwd.default._name == "tiled_attention::fwd"
assert torch.ops.tiled_attention_2.bwd.default._name == "tiled_attention_2::bwd"
q = torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
want = torch.nn.functional.scaled_dot_product_attention(q, q, q)
for m in (comfy, attention_core, third):
    out = m.scaled_dot_product_attention(q, q, q)
    assert (out - want).abs().max() < 1e-12
    out.sum().backward()
print("ok")
"""


def test_the_first_copy_is_tiled_attention_and_later_copies_are_numbered(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(PKG.parent)}
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, cwd=str(tmp_path), env=env,
                       timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, (r.stdout[-2000:], r.stderr[-2000:])

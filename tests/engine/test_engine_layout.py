"""The engine's house rules: imports flow one way (no cycles, function-local imports included), the folders are
layers (device <- kernel <- the public entry points and the commands), one source for tier names, one meaning per
precision word, a docstring stating each module's job."""
import ast
import pathlib
import re

import torch

import attention_core
from attention_core import selfcheck
from attention_core.kernel.numerics import PRECISIONS, choose_numerics

PKG = pathlib.Path(attention_core.__file__).parent


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts)
        yield (name[: -len(".__init__")] if name.endswith(".__init__") else name), path


def _imports(name, path):
    """attention_core modules `name` imports anywhere in its file (relative imports resolved)."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            parts = base[: len(base) - node.level + 1] if node.level else []
            mod = ".".join(parts + (node.module.split(".") if node.module else [])) if node.level else node.module
            if not (mod or "").startswith("attention_core"):
                continue
            out.add(mod)
            for a in node.names:  # "from . import chunked" names a module
                out.add(f"{mod}.{a.name}")
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("attention_core"))
    return out


def _top_level_imports(path):
    """The first name of every absolute import in the file (relative imports stay inside attention_core)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
    return out


# what `ls attention_core` shows: the public entry points and the documented commands at the top (where users call
# them: attention_core.scaled_dot_product_attention, attention_core.patch, python -m attention_core.plan ...), the
# kernel and the device knowledge each in its own subpackage
PUBLIC = {"attention_core", "attention_core.sdpa", "attention_core.patch", "attention_core.ffn",
          "attention_core.parallel", "attention_core.multidevice",
          "attention_core.ops",  # a documented path kept: re-exports kernel/ops.py (tests/engine/test_public_paths.py)
          "attention_core.integrations"}  # other libraries' registries (attn_implementation="tiled"), one module each
COMMANDS = {f"attention_core.{c}" for c in ("bench", "calibrate", "plan", "report", "selfcheck", "tune",
                                            "cli_args", "estimate")}  # the last two: what the commands share
LAYERS = ("attention_core.device", "attention_core.kernel")  # bottom first: each imports only itself and below
COMFYUI = {"comfy", "comfy_extras", "comfy_api", "folder_paths", "nodes", "server", "execution", "tools"}


def _layer(name):
    return next((i for i, pkg in enumerate(LAYERS) if name == pkg or name.startswith(pkg + ".")), len(LAYERS))


def test_the_top_level_holds_only_the_public_entry_points_and_the_commands():
    top = {m for m, path in _modules() if m.count(".") <= 1 and _layer(m) == len(LAYERS)}
    assert top == PUBLIC | COMMANDS, (
        f"new top-level module(s) {sorted(top - PUBLIC - COMMANDS)}: the kernel's internals go in "
        f"attention_core/kernel/, what the pack knows about devices in attention_core/device/; only public entry "
        f"points and documented commands live at the top (then add it to PUBLIC or COMMANDS here)")
    subpackages = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}
    # ffn/ is a public entry point (FFN chunking) split by duty, not a layer: it sits at the top with sdpa and patch
    # integrations/ (adapters into other libraries' attention registries) too: public, one module per library
    assert subpackages == {"kernel", "device", "ffn", "integrations"}, subpackages


def test_the_wheel_lists_every_subpackage():
    """pyproject.toml names the packages `pip install .` ships: a subpackage missing there is missing installed."""
    text = (PKG.parent / "pyproject.toml").read_text().split("[tool.setuptools]")[1]
    listed = set(re.findall(r'"(attention_core[\w.]*)"', text))
    folders = {".".join(p.relative_to(PKG.parent).parts[:-1]) for p in PKG.rglob("__init__.py")}
    assert listed == folders, f"pyproject.toml [tool.setuptools] packages: add {sorted(folders - listed)}, " \
                              f"drop {sorted(listed - folders)}"


def test_each_layer_imports_only_itself_and_the_layers_below():
    """device <- kernel <- the top (public entry points, commands): the kernel never imports the commands, the
    entry points above it or anything of ComfyUI; device knowledge never imports the kernel."""
    for name, path in _modules():
        for imp in _imports(name, path):
            assert _layer(imp) <= _layer(name), (
                f"{name} ({_layer(name) < len(LAYERS) and LAYERS[_layer(name)] or 'top level'}) imports {imp}, "
                f"a layer above it: move the shared piece down or the importer up")


def test_attention_core_never_imports_comfyui_the_nodes_or_the_tools():
    """The engine is importable alone (pip installs it alone). One exception, a command: `python -m
    attention_core.bench --comfyui PATH` times ComfyUI's own attention beside the engine's, imported in a function."""
    for name, path in _modules():
        bad = _top_level_imports(path) & COMFYUI - ({"comfy"} if name == "attention_core.bench" else set())
        assert not bad, f"{name} imports {sorted(bad)}: attention_core is the engine alone (pip installs it alone)"


def test_engine_imports_have_no_cycles():
    mods = dict(_modules())
    graph = {m: {i for i in _imports(m, p) if i in mods and i != m} for m, p in mods.items()}
    # a package's __init__ importing its own submodules is the package's public face, not a cycle
    graph = {m: {i for i in deps if not (m == "attention_core" or (i.startswith(m + ".") and
                                                                    mods[m].name == "__init__.py"))}
             for m, deps in graph.items()}
    state = {}

    def visit(m, stack):
        state[m] = "open"
        for d in graph[m]:
            if d.startswith(m + "."):
                continue
            if state.get(d) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack + [m, d]))
            if d not in state:
                visit(d, stack + [m])
        state[m] = "done"
    for m in graph:
        if m not in state:
            visit(m, [])


def test_every_engine_module_states_its_job():
    for name, path in _modules():
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and len(doc.split()) >= 5, f"{name} has no opening docstring"


def test_one_source_for_tier_names():
    from attention_core.kernel.tiers import ORDER, TIER_CHOICES, TIERS
    assert attention_core.TIERS == ORDER == tuple(TIERS)
    assert attention_core.TIER_CHOICES == TIER_CHOICES == ("auto",) + ORDER
    assert selfcheck.TIERS is ORDER


def test_precision_words_have_one_meaning():
    assert PRECISIONS == ("auto", "input", "fp16", "fp32")
    cpu = torch.device("cpu")
    # "input": the input dtype as it is, also on the CPU; "keep" is its deprecated alias, not "auto"
    assert choose_numerics(torch.float16, cpu, "input").compute == torch.float16
    assert choose_numerics(torch.float16, cpu, "keep") == choose_numerics(torch.float16, cpu, "input")
    assert choose_numerics(torch.float16, cpu, "auto").compute == torch.float32
    q = torch.randn(1, 1, 4, 8, dtype=torch.float16)
    try:
        attention_core.scaled_dot_product_attention(q, q, q, precision="half")
    except ValueError as e:
        assert "input" in str(e) and "precision" in str(e)
    else:
        raise AssertionError("an unknown precision was accepted")


def test_a_copy_imported_under_another_name_has_its_own_ops():
    """ComfyUI imports the node folder under its folder name; with `attention_core` also importable (pip, or a
    second copy), both must load and work: each copy registers its own op namespace."""
    import subprocess
    import sys
    code = f"""
import importlib.util, sys, types, torch
import attention_core
sys.modules["copy_pack"] = types.ModuleType("copy_pack")
sys.modules["copy_pack"].__path__ = []
spec = importlib.util.spec_from_file_location("copy_pack.attention_core", {str(PKG / "__init__.py")!r},
                                              submodule_search_locations=[{str(PKG)!r}])
mod = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = mod
spec.loader.exec_module(mod)
q = torch.randn(1, 2, 5, 4, requires_grad=True)
for m in (attention_core, mod):
    m.scaled_dot_product_attention(q, q, q).sum().backward()
assert attention_core.kernel.autograd.NS != mod.kernel.autograd.NS
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(PKG.parent),
                       timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]

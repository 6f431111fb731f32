"""The engine's house rules: imports flow one way (no cycles, function-local imports included), the folders are
layers (device <- kernel <- the public entry points <- cli/, the commands), one source for tier names, one meaning per
precision word, a docstring stating each module's job."""
import ast
import pathlib
import re

import torch

import attention_core
from attention_core.cli import selfcheck
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


# what `ls attention_core` shows: the public entry points at the top (where users call them:
# attention_core.scaled_dot_product_attention, attention_core.patch, ...), the kernel and the device knowledge each in
# its own subpackage, the commands in cli/ with a one-line alias each at the top (python -m attention_core.plan ...)
PUBLIC = {"attention_core", "attention_core.sdpa", "attention_core.patch", "attention_core.ffn",
          "attention_core.parallel", "attention_core.multidevice",
          "attention_core.ops",  # a documented path kept: re-exports kernel/ops.py (tests/engine/test_public_paths.py)
          "attention_core.version",  # the pack's version, pyproject.toml's (attention_core.__version__, --version)
          "attention_core.integrations"}  # the engine inside other libraries (integrations/diffusers.py, ...)
COMMANDS = ("bench", "calibrate", "plan", "report", "selfcheck", "tune")  # python -m attention_core.<command>
# the top-level names kept for users, each the cli/ module itself once imported: the commands, and estimate (a
# documented module path: attention_core.estimate.step_time)
ALIASES = {f"attention_core.{c}" for c in COMMANDS + ("estimate",)}
CLI = "attention_core.cli"  # the commands and what they share (cli_args, estimate, the benchmark's parts)
# bottom first: each imports only itself and below; the top-level public entry points sit between kernel and cli
LAYERS = ("attention_core.device", "attention_core.kernel", None, CLI)
COMFYUI = {"comfy", "comfy_extras", "comfy_api", "folder_paths", "nodes", "server", "execution", "tools"}
# the commands that time ComfyUI's own attention beside the engine's (--comfyui PATH), importing it in a function
WITH_COMFYUI = {"attention_core.cli.bench_methods", "attention_core.cli.bench_models.zimage"}


def _layer(name):
    if name in ALIASES:  # python -m attention_core.<command>: the command's own name, so the command's layer
        return LAYERS.index(CLI)
    return next((i for i, pkg in enumerate(LAYERS) if pkg and (name == pkg or name.startswith(pkg + "."))),
                LAYERS.index(None))


def _describe(layer):
    return LAYERS[layer] or "the top level"


def test_the_top_level_holds_only_the_public_entry_points_and_the_command_aliases():
    top = {m for m, path in _modules() if m.count(".") <= 1 and not m.startswith(LAYERS[:2]) and m != CLI}
    assert top == PUBLIC | ALIASES, (
        f"new top-level module(s) {sorted(top - PUBLIC - ALIASES)}: the kernel's internals go in "
        f"attention_core/kernel/, what the pack knows about devices in attention_core/device/, commands and what "
        f"they share in attention_core/cli/; only public entry points (PUBLIC here) and the commands' one-line "
        f"aliases live at the top")
    subpackages = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}
    # ffn/ and parallel/ are public entry points (FFN chunking; Ulysses and ring) split by duty, not layers: they sit
    # at the top with sdpa and patch; integrations/ holds one public entry point per library (diffusers, transformers)
    assert subpackages == {"kernel", "device", "ffn", "parallel", "integrations", "cli"}, subpackages


def test_the_commands_live_in_cli_and_their_top_level_names_are_aliases():
    """Each command is attention_core/cli/<command>.py with its `__main__` block; attention_core/<command>.py only
    runs it (python -m attention_core.<command>) and, imported, is that module (sys.modules), so
    `from attention_core.plan import X` and monkeypatching reach the one module."""
    import importlib
    for name in sorted(ALIASES):
        short = name.rsplit(".", 1)[1]
        path = PKG / f"{short}.py"
        tree = ast.parse(path.read_text())
        imports = {ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))}
        allowed = {"import sys", f"from .cli import {short} as _command", f"from .cli.{short} import main",
                   f"from .cli import {short} as _module"}
        assert imports <= allowed, f"{path.name} imports {sorted(imports - allowed)}: an alias runs cli/{short}.py only"
        assert len(path.read_text().splitlines()) <= 15, f"{path.name}: an alias is a few lines; code goes in cli/"
        real = importlib.import_module(f"{CLI}.{short}")
        assert importlib.import_module(name) is real, f"{name} is not {CLI}.{short} once imported"
        assert (PKG / "cli" / f"{short}.py").is_file()
        if short in COMMANDS:
            for tree_ in (tree, ast.parse((PKG / "cli" / f"{short}.py").read_text())):
                assert any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree_.body), short


def test_the_wheel_lists_every_subpackage():
    """pyproject.toml names the packages `pip install .` ships: a subpackage missing there is missing installed."""
    text = (PKG.parent / "pyproject.toml").read_text().split("[tool.setuptools]")[1]
    listed = set(re.findall(r'"(attention_core[\w.]*)"', text))
    folders = {".".join(p.relative_to(PKG.parent).parts[:-1]) for p in PKG.rglob("__init__.py")}
    assert listed == folders, f"pyproject.toml [tool.setuptools] packages: add {sorted(folders - listed)}, " \
                              f"drop {sorted(listed - folders)}"


def test_each_layer_imports_only_itself_and_the_layers_below():
    """device <- kernel <- the top (public entry points) <- cli (the commands): the kernel never imports the
    entry points above it or anything of ComfyUI; device knowledge never imports the kernel; no public entry point
    imports a command (only the commands' aliases name cli/)."""
    for name, path in _modules():
        for imp in _imports(name, path):
            assert _layer(imp) <= _layer(name), (
                f"{name} ({_describe(_layer(name))}) imports {imp} ({_describe(_layer(imp))}), a layer above it: "
                f"move the shared piece down or the importer up")


def _module_level_imports(path):
    """The first name of every absolute import outside functions (run when the module is imported)."""
    out = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.ImportFrom) and not child.level and child.module:
                out.add(child.module.split(".")[0])
            elif isinstance(child, ast.Import):
                out.update(a.name.split(".")[0] for a in child.names)
            visit(child)
    visit(ast.parse(path.read_text()))
    return out


def test_attention_core_never_imports_comfyui_the_nodes_or_the_tools():
    """The engine is importable alone (pip installs it alone). One exception, in commands: `python -m
    attention_core.bench --comfyui PATH` (its methods, its Z-Image preset) times ComfyUI's own attention beside the
    engine's, imported in a function, never when the module is imported."""
    for name, path in _modules():
        bad = _top_level_imports(path) & COMFYUI - ({"comfy"} if name in WITH_COMFYUI else set())
        assert not bad, f"{name} imports {sorted(bad)}: attention_core is the engine alone (pip installs it alone)"
        assert not _module_level_imports(path) & COMFYUI, f"{name} imports ComfyUI when imported"


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

"""The engine's house rules: imports flow one way (no cycles, function-local imports included), one source for
tier names, one meaning per precision word, a docstring stating each module's job."""
import ast
import pathlib

import torch

import attention_core
from attention_core import selfcheck
from attention_core.numerics import PRECISIONS, choose_numerics

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
    from attention_core.tiers import ORDER, TIER_CHOICES, TIERS
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

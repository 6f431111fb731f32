"""Every import path, attention_core name and `python -m attention_core.X` command the README (or docs/) has ever
documented stays importable (issue 30.6: `from attention_core.ops import attention_forward`, public API in the
README until the kernel moved into attention_core/kernel/, raised ModuleNotFoundError). The lists below come from
`git log -p -- README.md docs/` (every version); what the README and docs/ say today is read from the files, so a
path documented later is held too.

Red before: attention_core.ops (module and attribute) was gone."""
import ast
import importlib
import importlib.util
import pathlib
import re

import pytest

import attention_core

ROOT = pathlib.Path(attention_core.__file__).parents[1]

# `import` statements of every README / docs version
IMPORTS = [
    "import attention_core",
    "import attention_core as ac",
    "from attention_core.ops import attention_forward, attention_backward",
    "from attention_core.multidevice import scaled_dot_product_attention_on_devices",
    "from attention_core.parallel import ulysses_attention, ring_attention",
    "from attention_core.parallel import flash_layout_attention",
]
# dotted names (attention_core.x.y, and ac.x after `import attention_core as ac`) of every version
NAMES = [
    "attention_core.scaled_dot_product_attention", "attention_core.detect", "attention_core.enable",
    "attention_core.disable", "attention_core.patched", "attention_core.chunk_ffn", "attention_core.TIER_CHOICES",
    "attention_core.patch", "attention_core.selfcheck", "attention_core.estimate", "attention_core.estimate.step_time",
    "attention_core.ops.attention_forward", "attention_core.ops.attention_backward",
    "attention_core.kernel.ops.attention_forward", "attention_core.kernel.ops.attention_backward",
    "attention_core.parallel.ulysses_attention", "attention_core.parallel.ring_attention",
    "attention_core.parallel.flash_layout_attention",
    "attention_core.multidevice.scaled_dot_product_attention_on_devices",
]
# `python -m attention_core.X` commands of every version
COMMANDS = ["bench", "calibrate", "plan", "report", "selfcheck", "tune"]
# names reachable as attributes after a plain `import attention_core` when the README documented them
ATTRIBUTES = ["scaled_dot_product_attention", "detect", "enable", "disable", "patched", "is_enabled", "chunk_ffn",
              "TIER_CHOICES", "TIERS", "patch", "ops.attention_forward", "ops.attention_backward"]


def resolve(dotted: str):
    """The object a dotted name stands for: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(dotted)


def documented_now():
    """(imports, dotted names, commands) in today's README.md and docs/*.md."""
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    imports = set(re.findall(r"^\s*((?:from attention_core[\w.]* import [\w, ]+)|(?:import attention_core[\w.]*"
                             r"(?: as \w+)?))\s*$", text, re.M))
    names = {n.rstrip(".") for n in re.findall(r"\battention_core(?:\.[A-Za-z_]\w*)+", text)}
    names |= {"attention_core." + n for n in re.findall(r"\bac\.([A-Za-z_]\w*)", text)}
    commands = set(re.findall(r"python -m attention_core\.(\w+)", text))
    return imports, names, commands


@pytest.mark.parametrize("statement", IMPORTS)
def test_documented_import_statements_run(statement):
    exec(compile(statement, "<README>", "exec"), {})


@pytest.mark.parametrize("name", NAMES)
def test_documented_names_resolve(name):
    assert resolve(name) is not None


@pytest.mark.parametrize("name", ATTRIBUTES)
def test_documented_attributes_after_a_plain_import(name):
    obj = attention_core
    for part in name.split("."):
        obj = getattr(obj, part)


@pytest.mark.parametrize("command", COMMANDS)
def test_documented_commands_resolve(command):
    spec = importlib.util.find_spec(f"attention_core.{command}")
    assert spec is not None and spec.origin, command
    tree = ast.parse(pathlib.Path(spec.origin).read_text())
    assert any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body), \
        f"python -m attention_core.{command}: no `if __name__ == \"__main__\"` block"


def test_old_and_new_paths_are_the_same_functions():
    from attention_core import ops
    from attention_core.kernel import ops as kernel_ops
    assert ops.attention_forward is kernel_ops.attention_forward
    assert ops.attention_backward is kernel_ops.attention_backward


def test_what_the_docs_say_today_is_held_too():
    imports, names, commands = documented_now()
    assert "attention_core.kernel.ops.attention_forward" in names and "bench" in commands  # the scan works
    for statement in sorted(imports):
        exec(compile(statement, "<README>", "exec"), {})
    for name in sorted(names):
        assert resolve(name) is not None, name
    for command in sorted(commands):
        assert importlib.util.find_spec(f"attention_core.{command}") is not None, command
    assert set(commands) <= set(COMMANDS), "a new command: add it to COMMANDS"


def test_the_package_docstring_names_the_public_api():
    doc = attention_core.__doc__
    assert "Public API" in doc
    for name in ("scaled_dot_product_attention", "detect", "enable", "patched", "chunk_ffn", "TIER_CHOICES",
                 "attention_core.ops", "attention_forward", "attention_core.multidevice", "attention_core.parallel",
                 *COMMANDS):
        assert name in doc, name

"""The override notice names the pack whose override is in force even when that override reaches ComfyUI wrapped by
something no pack wrote (issue 38 item 5): a functools.partial, a function torch.compiler.disable wrapped, and the
two stacked. Inside a real ComfyUI (0.33.0 in-process): describe() on each wrapper, and the warning a real sampler
(KSampler on a tiny Wan 2.2 5B) logs when such an override replaced Patch Attention's. A wrapper a pack wrote itself
(functools.wraps) stays that pack's. Red before: "module functools: partial" and torch's module path instead of the
custom node folder."""
import asyncio
import functools
import logging
import sys

import pytest
import torch

from comfy_harness import PACK_NAME, comfy_nodes, load_tiny
from tools.fixtures.tiny_models import write_wan22_5b

pytestmark = pytest.mark.comfy_inprocess


def mod(name):
    return sys.modules[f"{PACK_NAME}.{name}"]


def pack_function(path, name="attention_override", tagged=False):
    """A function whose code says it was defined in `path` (as a custom node's module would be): an attention
    override that passes the call on to ComfyUI's function (with tagged=True it takes a first argument, bound by a
    partial, as packs bind their options)."""
    ns = {}
    head = "tag, func" if tagged else "func"
    exec(compile(f"def {name}({head}, *args, **kwargs):\n    return func(*args, **kwargs)\n", str(path), "exec"), ns)
    return ns[name]


def wrappers(fn, tagged_fn):
    return {
        "functools.partial": functools.partial(tagged_fn, "sage"),
        "torch.compiler.disable": torch.compiler.disable(fn),
        "partial of a disabled function": functools.partial(torch.compiler.disable(tagged_fn), "sage"),
        "disabled partial": torch.compiler.disable(functools.partial(tagged_fn, "sage")),
        "partial of a partial": functools.partial(functools.partial(tagged_fn), "sage"),
    }


@pytest.fixture
def pack_fns(pack, tmp_path):
    path = tmp_path / "custom_nodes" / "ComfyUI-PackD" / "attention.py"
    return pack_function(path), pack_function(path, tagged=True)


@pytest.mark.parametrize("kind", ["functools.partial", "torch.compiler.disable", "partial of a disabled function",
                                  "disabled partial", "partial of a partial"])
def test_describe_names_the_pack_under_wrappers_no_pack_wrote(pack, pack_fns, kind):
    notice = mod("nodes.override_notice")
    fn, tagged = pack_fns
    assert notice.describe(fn) == "custom node 'ComfyUI-PackD': attention_override"
    wrapped = wrappers(fn, tagged)[kind]
    assert notice.describe(wrapped) == "custom node 'ComfyUI-PackD': attention_override", notice.describe(wrapped)


def test_a_wrapper_a_pack_wrote_stays_that_packs(pack, pack_fns, tmp_path):
    """PackE wraps PackD's override with functools.wraps: PackE's code decides what runs, so PackE is named."""
    notice = mod("nodes.override_notice")
    inner, _ = pack_fns
    outer = functools.wraps(inner)(pack_function(tmp_path / "custom_nodes" / "PackE" / "wrap.py", "wrapper"))
    assert outer.__wrapped__ is inner
    assert notice.describe(outer).startswith("custom node 'PackE': ")
    assert notice.describe(functools.partial(outer)).startswith("custom node 'PackE': ")


@pytest.fixture(scope="module")
def wan(tmp_path_factory, pack):
    return load_tiny(tmp_path_factory, write_wan22_5b, "wan22_tiny.safetensors", "WAN22_T2V")


def sample(model):
    g = torch.Generator().manual_seed(1)
    latent, cond = torch.randn(1, 48, 1, 8, 8, generator=g), torch.randn(1, 12, 4096, generator=g)
    return comfy_nodes().KSampler().sample(model, 0, 1, 3.0, "euler", "simple", [[cond, {}]],
                                           [[torch.zeros_like(cond), {}]], {"samples": latent})[0]["samples"]


@pytest.mark.parametrize("kind", ["functools.partial", "torch.compiler.disable", "partial of a disabled function"])
def test_sampling_warning_names_the_pack(pack, wan, pack_fns, kind, caplog):
    """Patch Attention's override replaced (a later node on the MODEL wire) by a pack's override wrapped as `kind`:
    the warning the real sampler logs names the pack's folder and function, not functools or torch."""
    from comfy_execution.utils import CurrentNodeContext
    notice = mod("nodes.override_notice")
    notice._latest["notice"] = None
    notice._seen.update(prompt=None, keys=set())
    nodes = asyncio.run(asyncio.run(pack.comfy_entrypoint()).get_node_list())
    patch_node = {n.GET_SCHEMA().node_id: n for n in nodes}["TiledAttentionPatch"]
    patched = patch_node.execute(wan, "chunked", 0, "keep", 0)[0]
    replaced = patched.clone()
    options = replaced.model_options
    options["transformer_options"] = dict(options["transformer_options"],
                                          optimized_attention_override=wrappers(*pack_fns)[kind])
    caplog.set_level(logging.INFO, logger="tiled_attention")
    caplog.clear()
    with CurrentNodeContext(f"prompt-wrapped-{kind}", "9"):
        sample(replaced)
    warned = [r.getMessage() for r in caplog.records
              if r.name == "tiled_attention" and r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert "replaced by custom node 'ComfyUI-PackD': attention_override, which now answers" in warned[0], warned[0]
    assert "functools" not in warned[0] and "torch" not in warned[0].split("replaced by")[1].split(",")[0]
    notice._latest["notice"] = None


def test_a_packs_function_is_named_whatever_its_qualified_name_says(pack, tmp_path):
    """Only ComfyUI's own comfy.model_patcher closure is read as ModelAttentionBackend's: a pack's function with
    that closure's qualified name (from a module whose name sorts after comfy.model_patcher) is the pack's."""
    notice = mod("nodes.override_notice")
    fn = pack_function(tmp_path / "custom_nodes" / "ZPack" / "attention.py")
    fn.__qualname__ = notice.MAB_QUALNAME
    fn.__module__ = "zpack.attention"
    assert notice.describe(fn) == f"custom node 'ZPack': {notice.MAB_QUALNAME}"


def test_wrappers_are_looked_through_eight_levels_deep_and_no_deeper(pack, pack_fns):
    """defining() unwraps at most 8 levels: eight nested partials name the pack, a ninth leaves a partial.
    (Each level gets an attribute: functools.partial flattens a partial of a partial without one into one.)"""
    notice = mod("nodes.override_notice")
    fn, _ = pack_fns

    def wrap(f, level):
        p = functools.partial(f)
        p.level = level
        return p
    nested = fn
    for level in range(8):
        nested = wrap(nested, level)
    assert nested.func.func is not fn  # really nested
    assert notice.defining(nested) is fn
    assert notice.describe(nested) == "custom node 'ComfyUI-PackD': attention_override"
    deeper = wrap(nested, 8)
    left = notice.defining(deeper)
    assert isinstance(left, functools.partial) and left.func is fn  # the ninth level, not walked


def test_info_lines_are_not_kept_as_the_latest_notice(pack, pack_fns, monkeypatch):
    """The chain rule and a wrapping pack are info lines: logged, never the notice Attention Info reports; only a
    replaced override (the warning) is kept."""
    import types
    notice = mod("nodes.override_notice")
    monkeypatch.setitem(notice._latest, "notice", None)
    monkeypatch.setattr(notice, "current_prompt_id", lambda: None)  # outside a prompt: every line is said

    def expected(*a, **k):
        return None

    def other_patch(*a, **k):
        return None
    setattr(other_patch, notice.MARK, types.SimpleNamespace(node="Patch Attention", mode="online"))
    fn, _ = pack_fns
    assert notice.check(other_patch, expected, "Patch Attention") == "other patch"
    assert notice.check(functools.partial(fn, expected), expected, "Patch Attention") == "wrapped"
    assert notice.latest() is None
    assert notice.check(fn, expected, "Patch Attention") == "not in force"
    assert notice.latest() is not None and "ComfyUI-PackD" in notice.latest().text

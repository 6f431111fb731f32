"""Patch Attention says when its model samples without the node's attention override in force
(nodes/override_notice.py), inside a real ComfyUI (0.33.0 in-process; 0.3.75 through tests/comfy/test_inprocess_on_oldest.py): the real sampler
(KSampler) on a tiny Wan 2.2 5B, the real core ModelAttentionBackend node (0.33.0), the test-only stand-in for KJNodes'
Patch Sage Attention (tools/fixtures/sage_override_standin), prompts told apart by ComfyUI's own executing context.
Also: the error for heads that do not split q names the route that took the call (item 12 of issue 30).
The same orders through /prompt of real servers: tests/comfy/test_override_notice_e2e.py."""
import asyncio
import logging
import sys

import pytest
import torch

from comfy_harness import PACK_NAME, comfy_nodes, load_tiny, require_comfy
from tools.fixtures.tiny_models import write_wan22_5b

pytestmark = pytest.mark.comfy_inprocess

WARNING = "is not in force while this model samples"


def mod(name):
    return sys.modules[f"{PACK_NAME}.{name}"]


@pytest.fixture(scope="module")
def node(pack):
    nodes = asyncio.run(asyncio.run(pack.comfy_entrypoint()).get_node_list())
    by_id = {n.GET_SCHEMA().node_id: n for n in nodes}
    return lambda node_id, *args: by_id[node_id].execute(*args)[0]


@pytest.fixture(scope="module")
def wan(tmp_path_factory, pack):
    return load_tiny(tmp_path_factory, write_wan22_5b, "wan22_tiny.safetensors", "WAN22_T2V")


@pytest.fixture
def notices(pack, caplog):
    """The pack's notices: the warnings and infos logged from here on, with no notice kept from earlier tests."""
    notice = mod("nodes.override_notice")
    notice._latest["notice"] = None
    notice._seen.update(prompt=None, keys=set())
    caplog.set_level(logging.INFO, logger="tiled_attention")
    caplog.clear()

    def said(level=logging.WARNING):
        return [r.getMessage() for r in caplog.records if r.name == "tiled_attention" and r.levelno == level]
    yield said
    notice._latest["notice"] = None


def patch(node, model, mode="chunked"):
    return node("TiledAttentionPatch", model, mode, 0, "keep", 0)


def model_attention_backend(model):
    """Core ModelAttentionBackend (ComfyUI 0.33.0) as its node runs it, choosing "pytorch attention"."""
    try:
        from comfy_extras.nodes_model_advanced import ModelAttentionBackend
    except ImportError:
        pytest.skip("not applicable: this ComfyUI has no ModelAttentionBackend node (0.3.75); the other pack's "
                    "override is tested here instead")
    return ModelAttentionBackend().patch(model, "pytorch attention")[0]


def sage_standin(model):
    require_comfy()
    from tools.fixtures.sage_override_standin import PathchSageAttentionKJStandin
    return PathchSageAttentionKJStandin().patch(model, "auto")[0]


def sample(model, seed=0):
    g = torch.Generator().manual_seed(1)
    latent, cond = torch.randn(1, 48, 1, 8, 8, generator=g), torch.randn(1, 12, 4096, generator=g)
    positive, negative = [[cond, {}]], [[torch.zeros_like(cond), {}]]
    return comfy_nodes().KSampler().sample(model, seed, 1, 3.0, "euler", "simple", positive, negative,
                                           {"samples": latent})[0]["samples"]


def in_prompt(prompt_id, node_id="9"):
    from comfy_execution.utils import CurrentNodeContext  # what ComfyUI's executor sets around each node
    return CurrentNodeContext(prompt_id, node_id)


@pytest.mark.parametrize("mode", ["online", "inplace", "auto"])
def test_every_mode_of_patch_attention_is_watched(node, wan, notices, mode):
    """Whatever the mode (not only chunked), Patch Attention replaced by a later override is said. Fresh draw
    247072's survivor (mode != "off" as < "off" skipped online), written after the draw."""
    replaced = sage_standin(patch(node, wan, mode))
    with in_prompt(f"prompt-{mode}"):
        sample(replaced)
    warned = notices()
    assert len(warned) == 1 and f"(mode {mode}) is not in force" in warned[0], warned


def test_model_attention_backend_after_patch_attention_is_named_once_per_prompt(node, wan, notices):
    replaced = model_attention_backend(patch(node, wan))
    with in_prompt("prompt-1"):
        sample(replaced)
        sample(replaced, seed=1)  # a second sampler on the same model in the same prompt: said once
    warned = notices()
    assert len(warned) == 1, warned
    assert "Patch Attention (tiled)" in warned[0] and "ModelAttentionBackend (ComfyUI core)" in warned[0]
    assert "backend 'pytorch' (attention_pytorch" in warned[0]
    with in_prompt("prompt-2"):
        sample(replaced)
    assert len(notices()) == 2  # the next prompt says it again
    n = mod("nodes.override_notice").latest()
    assert n.prompt_id == "prompt-2" and "ModelAttentionBackend" in n.text
    info = mod("nodes.info").report_text()
    assert "latest notice (prompt prompt-2" in info and "ModelAttentionBackend (ComfyUI core)" in info


def test_patch_attention_after_model_attention_backend_wins_silently(node, wan, notices):
    ours = patch(node, model_attention_backend(wan))
    settings = ours.model_options["transformer_options"]["optimized_attention_override"]._tiled_attention
    with in_prompt("prompt-3"):
        sample(ours)
    assert notices() == [] and settings.stats["engine"] > 0
    assert "no notice" in mod("nodes.info").report_text()


def test_another_packs_override_after_patch_attention_is_named(node, wan, notices):
    from tools.fixtures import sage_override_standin as standin
    replaced = sage_standin(patch(node, wan))
    calls = standin.STATS["calls"]
    with in_prompt("prompt-4"):
        sample(replaced)
    warned = notices()
    assert len(warned) == 1 and "PathchSageAttentionKJStandin.patch.<locals>.attention_override_sage" in warned[0]
    assert standin.STATS["calls"] > calls  # what the notice says is true: the stand-in computed the attention


def test_another_packs_override_before_patch_attention_is_passed_on_silently(node, wan, notices):
    ours = patch(node, sage_standin(wan))
    settings = ours.model_options["transformer_options"]["optimized_attention_override"]._tiled_attention
    with in_prompt("prompt-5"):
        sample(ours)
    assert notices() == [] and settings.stats["engine"] > 0


def test_two_patch_attention_nodes_the_later_wins_quietly(node, wan, notices):
    first = patch(node, wan, "online")
    second = patch(node, first, "chunked")
    assert any("replaces the attention override of an earlier Patch Attention (tiled) (mode online)" in m
               for m in notices(logging.INFO))
    with in_prompt("prompt-6"):
        sample(second)
    assert notices() == []


def test_mode_off_after_another_override_is_no_accident(node, wan, notices):
    off = patch(node, sage_standin(patch(node, wan)), "off")  # the stand-in's override stays, ours is gone
    with in_prompt("prompt-7"):
        sample(off)
    assert notices() == []


def test_mode_off_after_patch_attention_removes_it_quietly(node, wan, notices):
    off = patch(node, patch(node, wan), "off")
    assert "optimized_attention_override" not in off.model_options["transformer_options"]
    with in_prompt("prompt-7b"):
        sample(off)
    assert notices() == []
    assert any("removes the attention override of an earlier Patch Attention (tiled)" in m
               for m in notices(logging.INFO))


def test_an_override_that_wraps_ours_keeps_it_in_force(node, wan, notices):
    """A pack that keeps the override it found and calls it (a closure over it) leaves ours in force: info only."""
    ours = patch(node, wan)
    m = ours.clone()
    found = m.model_options["transformer_options"]["optimized_attention_override"]

    def wrapping_override(func, *args, **kwargs):
        return found(func, *args, **kwargs)
    m.model_options["transformer_options"]["optimized_attention_override"] = wrapping_override
    with in_prompt("prompt-8"):
        sample(m)
    assert notices() == []
    assert any("runs inside" in msg and "wrapping_override" in msg for msg in notices(logging.INFO))


def test_another_patch_attentions_override_in_force_is_the_chain_rule(node, wan, notices):
    """Options carrying another Patch Attention's override (not the one this model's check expects) are the chain
    rule: info, no warning."""
    m = patch(node, wan, "chunked").clone()
    other = patch(node, wan, "online").model_options["transformer_options"]["optimized_attention_override"]
    m.model_options["transformer_options"]["optimized_attention_override"] = other
    with in_prompt("prompt-10"):
        sample(m)
    assert notices() == []
    assert any("the override of another Patch Attention (tiled) (mode online) is in force" in msg
               for msg in notices(logging.INFO))


def test_a_removed_override_is_named_as_comfyuis_own_attention(node, wan, notices):
    m = patch(node, wan).clone()
    del m.model_options["transformer_options"]["optimized_attention_override"]
    sample(m)  # outside a prompt: said at every sampling
    sample(m)
    warned = notices()
    assert len(warned) == 2 and "no override at all (ComfyUI's own attention, attention_" in warned[0]


def test_the_check_follows_clones(node, wan, notices):
    """The check is on the model patcher: clones made after Patch Attention (LoRA loaders, other patches) keep it."""
    replaced = sage_standin(patch(node, wan).clone().clone())
    with in_prompt("prompt-9"):
        sample(replaced)
    assert len(notices()) == 1


# ------------------------------------------------------------------------------------------- item 12: heads error


def bad_heads_call():
    torch.manual_seed(0)
    return torch.randn(1, 6, 12)  # 12 does not split into 5 heads


def test_heads_error_names_the_model_node(node, wan):
    from comfy.ldm.modules import attention
    override = patch(node, wan).model_options["transformer_options"]["optimized_attention_override"]
    q = bad_heads_call()
    with pytest.raises(ValueError) as e:
        attention.optimized_attention(q, q, q, 5, transformer_options={"optimized_attention_override": override})
    msg = str(e.value)
    assert msg.startswith("Patch Attention (tiled): q of shape (1, 6, 12) (k (1, 6, 12)) does not split into 5 heads")
    assert "not a multiple of 5" in msg and "set Patch Attention (tiled)'s min_tokens to 7 or more" in msg


def test_heads_error_names_the_clip_node(node, tmp_path_factory):
    import comfy.sd
    import tools.fixtures.tiny_model_loaders  # noqa: F401 - the test-only loader shim: the tiny sizes reach the loader
    from tools.fixtures.tiny_models import write_umt5
    path = write_umt5(str(tmp_path_factory.mktemp("te") / "umt5_tiny.safetensors"))
    clip = comfy.sd.load_clip(ckpt_paths=[path], clip_type=comfy.sd.CLIPType.WAN)
    patched = node("TiledAttentionPatchCLIP", clip, "chunked", 0, "keep", 0)
    route = next(p for p in patched.patcher.object_patches.values() if hasattr(p, "make_attention"))
    attention = route.make_attention(None)  # what the route hands the text encoder's attention module
    q = bad_heads_call()
    with pytest.raises(ValueError, match=r"^Patch Attention \(CLIP, tiled\): q of shape \(1, 6, 12\).*"
                                         r"set Patch Attention \(CLIP, tiled\)'s min_tokens to 7 or more"):
        attention(q, q, q, 5)


def test_heads_error_names_the_process_wide_route(pack):
    from comfy.ldm.modules import attention
    everywhere = mod("nodes.everywhere")
    assert everywhere.state()["mode"] == "off"
    q = bad_heads_call()
    try:
        everywhere.set_mode("chunked", 0)
        with pytest.raises(ValueError, match=r"^Tiled Attention Everywhere: q of shape \(1, 6, 12\).*"
                                             r"set Tiled Attention Everywhere's min_tokens to 7 or more"):
            attention.optimized_attention(q, q, q, 5)
    finally:
        everywhere.set_mode("off")


def test_heads_error_names_the_registered_backend(pack):
    from comfy.ldm.modules import attention
    get = getattr(attention, "get_attention_function", None)
    if get is None or get("tiled", None) is None:
        pytest.skip("not applicable: this ComfyUI has no attention backend registry")
    q = bad_heads_call()
    with pytest.raises(ValueError, match=r"^attention backend 'tiled': .*choose another attention backend"):
        get("tiled")(q, q, q, 5)


# ------------------------------------------------------------------------------------------- naming what is in force


def function_in(path, name="attention_override"):
    """A function whose code says it was defined in the file `path` (as a custom node's module would be)."""
    ns = {}
    exec(compile(f"def {name}(func, *args, **kwargs):\n    return func(*args, **kwargs)\n", str(path), "exec"), ns)
    return ns[name]


def test_custom_node_folder_is_the_pack_that_defines_the_function(pack, tmp_path, monkeypatch):
    notice = mod("nodes.override_notice")
    # under a custom_nodes directory: the folder (or single file) right under it, however deep the file is
    assert notice.custom_node_folder(function_in(tmp_path / "custom_nodes" / "PackB" / "a" / "b" / "x.py")) == "PackB"
    assert notice.custom_node_folder(function_in(tmp_path / "custom_nodes" / "one_file.py")) == "one_file"
    # an installed library in a venv kept inside a pack's folder (as this pack's test checkouts keep theirs) is the
    # library's, not the pack's: torch.compiler.disable's wrapper must not name the pack holding the venv
    venv = tmp_path / "custom_nodes" / "PackV" / ".venv" / "lib" / "python3.11"
    assert notice.custom_node_folder(function_in(venv / "site-packages" / "torch" / "eval_frame.py")) is None
    assert notice.custom_node_folder(function_in(venv / "dist-packages" / "torch" / "eval_frame.py")) is None
    # elsewhere (a custom node path from extra_model_paths.yaml): the longest folder pack ComfyUI loaded holding it;
    # a single-file pack's entry is the folder holding that file and names no other pack in that folder
    root = tmp_path / "my_nodes"
    nodes_module = comfy_nodes()
    monkeypatch.setattr(nodes_module, "LOADED_MODULE_DIRS", {
        "lone_script": str(root), "ComfyUI-SomePack": str(root / "ComfyUI-SomePack"),
        "inner": str(root / "ComfyUI-SomePack" / "vendored" / "inner")})
    assert notice.custom_node_folder(function_in(root / "ComfyUI-SomePack" / "attn.py")) == "ComfyUI-SomePack"
    assert notice.custom_node_folder(function_in(root / "ComfyUI-SomePack" / "vendored" / "inner" / "a.py")) == "inner"
    assert notice.custom_node_folder(function_in(root / "lone_script.py")) is None
    assert notice.custom_node_folder(function_in(tmp_path / "elsewhere" / "x.py")) is None
    assert notice.describe(function_in(tmp_path / "elsewhere" / "x.py", "f")).startswith("module builtins: f")
    # the deepest folder holding the file wins whatever order ComfyUI loaded the packs in
    monkeypatch.setattr(nodes_module, "LOADED_MODULE_DIRS", {
        "inner": str(root / "ComfyUI-SomePack" / "vendored" / "inner"),
        "ComfyUI-SomePack": str(root / "ComfyUI-SomePack"), "other": str(root / "other")})
    assert notice.custom_node_folder(function_in(root / "ComfyUI-SomePack" / "vendored" / "inner" / "a.py")) == "inner"


def test_comfyui_installed_inside_a_pack_folder_is_still_comfyui(pack, tmp_path, monkeypatch):
    """ComfyUI's own code is ComfyUI's even when ComfyUI lives under some custom_nodes/<pack> folder (this pack's
    test checkouts sit in <pack>/.cache inside ComfyUI/custom_nodes/tiled-attention): only ComfyUI's own
    custom_nodes folder holds packs."""
    import comfy
    notice = mod("nodes.override_notice")
    for name in ("comfyui-x", "comfyui-xy"):  # root paths of both parities of length
        root = tmp_path / "ComfyUI" / "custom_nodes" / "tiled-attention" / ".cache" / name
        monkeypatch.setattr(comfy, "__file__", str(root / "comfy" / "__init__.py"), raising=False)
        assert notice.custom_node_folder(function_in(root / "comfy" / "ldm" / "modules" / "attention.py")) is None
        assert notice.custom_node_folder(function_in(root / "comfy_extras" / "nodes_x.py")) is None
        assert notice.custom_node_folder(function_in(root / "custom_nodes" / "PackC" / "a" / "b.py")) == "PackC"
        assert notice.custom_node_folder(function_in(root / "custom_nodes" / "one_file.py")) == "one_file"
        assert notice.custom_node_folder(function_in(root / "custom_nodes")) is None  # no pack below it
    # code outside that ComfyUI: the rules above (the folder right under the nearest custom_nodes)
    assert notice.custom_node_folder(function_in(tmp_path / "ComfyUI" / "custom_nodes" / "tiled-attention" /
                                                 "nodes" / "x.py")) == "tiled-attention"


def set_model_optimized_attention(model, fn):
    if not hasattr(model, "set_model_optimized_attention"):
        pytest.skip("not applicable: this ComfyUI has no ModelPatcher.set_model_optimized_attention (0.3.75)")
    m = model.clone()
    m.set_model_optimized_attention(fn)
    return m.model_options["transformer_options"]["optimized_attention_override"]


def test_model_attention_backend_names_the_backend_it_chose(pack, wan):
    from comfy.ldm.modules import attention
    notice = mod("nodes.override_notice")
    tiled = notice.describe(set_model_optimized_attention(wan, attention.get_attention_function("tiled")))
    assert tiled == "ModelAttentionBackend (ComfyUI core), backend 'tiled' (attention_tiled)"
    pytorch = notice.describe(set_model_optimized_attention(wan, attention.get_attention_function("pytorch")))
    assert pytorch.startswith("ModelAttentionBackend (ComfyUI core), backend 'pytorch' (attention_pytorch: torch's")
    unregistered = notice.describe(set_model_optimized_attention(wan, attention.attention_basic))
    assert unregistered == "ModelAttentionBackend (ComfyUI core), backend attention_basic"


def test_a_registered_backend_a_pack_wrote_is_model_attention_backend_s_choice(pack, wan, tmp_path, monkeypatch):
    """A backend in ComfyUI's registry (a wrap_attn-style wrapper whose __wrapped__ is a pack's function, as this
    pack's own 'tiled' is in a real install under custom_nodes/) is named as ModelAttentionBackend's choice."""
    from comfy.ldm.modules import attention
    fn = function_in(tmp_path / "custom_nodes" / "PackR" / "attn.py", "attention_packr")
    if not hasattr(attention, "wrap_attn"):
        pytest.skip("not applicable: this ComfyUI has no wrap_attn (0.3.75)")
    # ComfyUI's own wrapper (defined in comfy/), never one written here: in an install under custom_nodes/ a wrapper
    # defined in this file would itself be the pack 'tiled-attention's code
    wrapped = attention.wrap_attn(fn)
    monkeypatch.setitem(attention.REGISTERED_ATTENTION_FUNCTIONS, "packr", wrapped)
    described = mod("nodes.override_notice").describe(set_model_optimized_attention(wan, wrapped))
    assert described == "ModelAttentionBackend (ComfyUI core), backend 'packr' (attention_packr)", described


def test_a_pack_through_set_model_optimized_attention_is_named_by_its_folder(pack, wan, tmp_path):
    fn = function_in(tmp_path / "custom_nodes" / "PackC" / "attn.py", "pack_attention")
    described = mod("nodes.override_notice").describe(set_model_optimized_attention(wan, fn))
    assert described == "custom node 'PackC' (through ModelPatcher.set_model_optimized_attention): pack_attention"


def test_holds_follows_wrappers_to_the_documented_depth(pack):
    import functools
    holds = mod("nodes.override_notice").holds

    def target(func, *args, **kwargs):
        return func(*args, **kwargs)
    def wrapping(inner):
        def wrapper(func, *args, **kwargs):
            return inner(func, *args, **kwargs)
        return wrapper
    nested = target
    for _ in range(4):
        nested = wrapping(nested)  # each wrapper is one level: a closure cell
    assert holds(nested, target)  # 4 levels: found
    assert not holds(wrapping(nested), target)  # 5 levels: past the documented depth
    assert holds(functools.partial(target, None), target)  # functools.partial's func
    assert holds(functools.partial(print, target), target)  # and its args

    class Holder:
        def __call__(self, *a):
            return self.attention(*a)
    h = Holder()
    h.attention, h.me = target, h  # a callable object holding it under a name of its own, and a cycle
    assert holds(h, target) and not holds(h, lambda: None)
    assert holds([h], target) and holds({"k": (h,)}, target)
    # at most `budget` objects are opened: behind 300 others at the first level, the holder is never opened
    crowd = [Holder() for _ in range(300)] + [h]
    assert holds(crowd, target, budget=400) and not holds(crowd, target)
    # a closure with an empty cell (a variable assigned after the function was made, never reached) is searched,
    # not an error
    def with_empty_cell():
        def inner(*a):
            return later(*a)  # noqa: F821 - assigned below, never reached
        return inner
        later = target  # noqa: F841
    assert not holds(with_empty_cell(), target) and holds([with_empty_cell(), target], target)
    # the default budget is 256 objects exactly: the list and 254 others opened before the holder (256th) finds it,
    # one more other and the holder would be the 257th
    assert holds([Holder() for _ in range(254)] + [h], target)
    assert not holds([Holder() for _ in range(255)] + [h], target)


def test_a_notice_is_immutable(pack):
    """The latest notice is shared with Attention Info on other threads: a frozen record, replaced whole."""
    import dataclasses
    notice = mod("nodes.override_notice").Notice("prompt-1", "text", 0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        notice.text = "changed"
    assert hash(notice) == hash(mod("nodes.override_notice").Notice("prompt-1", "text", 0.0))


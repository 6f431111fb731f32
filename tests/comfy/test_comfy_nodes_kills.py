"""The ComfyUI adapter's calling conventions, argument by argument (issue 13: tests that kill the mutants of
nodes/comfy_adapter.py the node tests could not see), and the other nodes' mutants the node tests missed (Attention
Info's hint, the text encoder's fallback, clone callbacks outside ComfyUI, nested text connectors). The pack is loaded
as ComfyUI loads it, in a real ComfyUI; every attention result is compared with torch's SDPA on the same inputs."""
import importlib
import sys

import pytest
import torch
import torch.nn.functional as F

from comfy_harness import load_pack


@pytest.fixture(scope="module")
def adapter():
    load_pack()
    from tiled_attention_pack.nodes import comfy_adapter
    return comfy_adapter


def heads_of(t, h):
    b, n, hd = t.shape
    return t.view(b, n, h, hd // h).transpose(1, 2)


def merged(t):
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b, n, h * d)


def test_bind_call_names_positional_and_keyword_arguments(adapter):
    q = torch.zeros(1, 2, 4)
    call = adapter.bind_call((q, q, q, 2), {"mask": "m", "skip_output_reshape": True})
    assert call["heads"] == 2 and call["mask"] == "m" and call["skip_output_reshape"] is True
    assert call["attn_precision"] is None and call["skip_reshape"] is False
    call = adapter.bind_call((q, q, q), {"heads": 3})
    assert call["heads"] == 3 and call["mask"] is None
    with pytest.raises(TypeError, match="at most 8 positional"):
        adapter.bind_call((q,) * 9, {})
    with pytest.raises(TypeError, match="without heads"):
        adapter.bind_call((q, q, q), {})
    with pytest.raises(TypeError, match="without v"):
        adapter.bind_call((q, q), {"heads": 1})


def test_heads_that_do_not_split_the_width_are_named(adapter):
    fn = adapter.make_override(adapter.PatchSettings(mode="chunked"))
    q = torch.randn(1, 5, 12)
    with pytest.raises(ValueError, match=r"does not split into 5 heads"):
        fn(None, q, q, q, 5)
    with pytest.raises(ValueError, match=r"does not split into 0 heads"):
        fn(None, q, q, q, 0)


@pytest.mark.parametrize("mask_shape", [(9,), (6, 9), (2, 6, 9), (2, 1, 6, 9), (2, 1, 1, 9)])
def test_masks_in_comfy_shapes(adapter, mask_shape):
    """2-D (Nq, Nk) -> (1, 1, Nq, Nk), 3-D (B, Nq, Nk) -> (B, 1, Nq, Nk), 4-D and 1-D (Nk: one bias a key, as
    ComfyUI's attention_pytorch passes it to torch) as they are; float masks are added."""
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 6, 16), torch.randn(2, 9, 16), torch.randn(2, 9, 16)
    mask = torch.randn(*mask_shape) * 3
    out = adapter.make_override(adapter.PatchSettings(mode="online"))(None, q, k, v, 4, mask)
    m4 = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape)) if mask.dim() != 3 else mask.unsqueeze(1)
    ref = merged(F.scaled_dot_product_attention(heads_of(q, 4), heads_of(k, 4), heads_of(v, 4), m4))
    assert torch.allclose(out, ref, atol=1e-5)


def test_min_tokens_is_a_strict_lower_bound_on_the_longer_sequence(adapter):
    settings = adapter.PatchSettings(mode="chunked", min_tokens=9)
    fn = adapter.make_override(settings)
    q, k = torch.randn(1, 6, 8), torch.randn(1, 9, 8)
    fn(_comfy_like, q, k, k, 2)  # max(6, 9) = 9: not below 9
    assert settings.stats == {"engine": 1, "passthrough": 0}
    fn(_comfy_like, q, q, q, 2)  # 6 < 9: ComfyUI's own attention
    assert settings.stats == {"engine": 1, "passthrough": 1}


def _comfy_like(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                **kw):
    out = F.scaled_dot_product_attention(heads_of(q, heads), heads_of(k, heads), heads_of(v, heads))
    return merged(out)


def test_passthrough_goes_to_the_previous_override_with_the_callers_arguments(adapter):
    seen = []

    def previous(func, *args, **kwargs):
        seen.append((func, len(args), sorted(kwargs)))
        return func(*args, **kwargs)
    settings = adapter.PatchSettings(mode="off")
    fn = adapter.make_override(settings, previous)
    q = torch.randn(1, 4, 8)
    out = fn(_comfy_like, q, q, q, 2, mask=None, transformer_options={})
    assert seen == [(_comfy_like, 4, ["mask", "transformer_options"])]
    assert torch.allclose(out, _comfy_like(q, q, q, 2)) and settings.stats["passthrough"] == 1
    assert fn.previous is previous and getattr(fn, adapter.MARK) is settings


def test_engine_options_follow_the_settings_and_the_call(adapter, monkeypatch):
    """mode -> tier, memory_budget_mb -> bytes, half_precision -> precision; attn_precision=fp32 or
    low_precision_attention=False (with bf16_to_fp16) ask for fp32."""
    seen = []
    real = adapter.scaled_dot_product_attention

    def spy(*a, **kw):
        seen.append({k: kw[k] for k in ("tier", "memory_budget", "precision", "scale", "enable_gqa")})
        return real(*a, **kw)
    monkeypatch.setattr(adapter, "scaled_dot_product_attention", spy)
    q = torch.randn(1, 4, 8)
    S = adapter.PatchSettings
    adapter.make_override(S(mode="inplace", memory_budget_mb=3, half_precision="bf16_to_fp16"))(None, q, q, q, 2)
    adapter.make_override(S(mode="online"))(None, q, q, q, 2, attn_precision=torch.float32)
    adapter.make_override(S(mode="online", half_precision="bf16_to_fp16"))(None, q, q, q, 2,
                                                                           low_precision_attention=False)
    adapter.make_override(S(mode="online", half_precision="keep"))(None, q, q, q, 2, low_precision_attention=False,
                                                                   scale=0.5)
    adapter.make_override(S(mode="chunked", half_precision="bf16_to_fp16"))(None, q, q, q, 2,
                                                                            low_precision_attention=True)
    assert seen == [
        {"tier": "inplace", "memory_budget": 3 << 20, "precision": "fp16", "scale": None, "enable_gqa": False},
        {"tier": "online", "memory_budget": None, "precision": "fp32", "scale": None, "enable_gqa": False},
        {"tier": "online", "memory_budget": None, "precision": "fp32", "scale": None, "enable_gqa": False},
        {"tier": "online", "memory_budget": None, "precision": "auto", "scale": 0.5, "enable_gqa": False},
        {"tier": "chunked", "memory_budget": None, "precision": "fp16", "scale": None, "enable_gqa": False},
    ]


def test_auto_mode_asks_detection_for_the_queries_device(adapter, monkeypatch):
    asked = []

    class Report:
        needs_tiled_attention = True
    monkeypatch.setattr(adapter, "detect", lambda device: asked.append(device) or Report())
    settings = adapter.PatchSettings(mode="auto")
    q = torch.randn(1, 4, 8)
    out = adapter.make_override(settings)(_comfy_like, q, q, q, 2)
    assert asked == [q.device] and settings.stats["engine"] == 1
    assert torch.allclose(out, _comfy_like(q, q, q, 2), atol=1e-6)


def test_skip_reshape_and_skip_output_reshape_each_on_their_own(adapter):
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 5, 12), torch.randn(2, 7, 12), torch.randn(2, 7, 12)
    ref4 = F.scaled_dot_product_attention(heads_of(q, 3), heads_of(k, 3), heads_of(v, 3))
    fn = adapter.make_override(adapter.PatchSettings(mode="chunked"))
    out = fn(None, q, k, v, 3, skip_output_reshape=True)  # [B, N, H*D] in, [B, H, N, D] out
    assert out.shape == (2, 3, 5, 4) and torch.allclose(out, ref4, atol=1e-5)
    out = fn(None, heads_of(q, 3), heads_of(k, 3), heads_of(v, 3), 3, skip_reshape=True)  # heads in, merged out
    assert out.shape == (2, 5, 12) and torch.allclose(out, merged(ref4), atol=1e-5)


def test_gqa_with_value_width_different_from_key_width(adapter):
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 5, 4 * 8), torch.randn(1, 6, 2 * 8), torch.randn(1, 6, 2 * 3)
    out = adapter.make_override(adapter.PatchSettings(mode="online"))(None, q, k, v, 4, enable_gqa=True)
    ref = F.scaled_dot_product_attention(heads_of(q, 4), heads_of(k, 2), heads_of(v, 2), enable_gqa=True)
    assert out.shape == (1, 5, 4 * 3) and torch.allclose(out, merged(ref), atol=1e-5)


def test_install_replaces_this_packs_override_and_keeps_a_foreign_one(adapter):
    class Patcher:
        def __init__(self, options=None):
            self.model_options = options or {}

        def clone(self):
            import copy
            return Patcher(copy.copy({k: dict(v) if isinstance(v, dict) else v
                                      for k, v in self.model_options.items()}))
    foreign = lambda func, *a, **kw: func(*a, **kw)  # noqa: E731
    base = Patcher({"transformer_options": {adapter.OVERRIDE_KEY: foreign}})
    S = adapter.PatchSettings
    one = adapter.install(base, S(mode="online"))
    two = adapter.install(one, S(mode="chunked"))
    fn = two.model_options["transformer_options"][adapter.OVERRIDE_KEY]
    assert getattr(fn, adapter.MARK).mode == "chunked" and fn.previous is foreign
    assert base.model_options["transformer_options"][adapter.OVERRIDE_KEY] is foreign
    assert adapter.install(two, S(mode="off")).model_options["transformer_options"][adapter.OVERRIDE_KEY] is foreign
    bare = adapter.install(adapter.install(Patcher(), S(mode="online")), S(mode="off"))
    assert adapter.OVERRIDE_KEY not in bare.model_options["transformer_options"]


def test_min_tokens_reads_the_sequence_length_in_both_layouts(adapter):
    """min_tokens compares against the longer of Nq and Nk, whether q/k come as [B, N, H*D] or (skip_reshape) as
    [B, H, N, D] (H = 2 here, below min_tokens; one sequence is 20 >= 10, the other 5)."""
    settings = adapter.PatchSettings(mode="chunked", min_tokens=10)
    fn = adapter.make_override(settings)
    long, short = torch.randn(1, 20, 2 * 8), torch.randn(1, 5, 2 * 8)
    for q, k in ((long, short), (short, long)):
        fn(None, heads_of(q, 2), heads_of(k, 2), heads_of(k, 2), 2, skip_reshape=True)
        fn(None, q, k, k, 2)
    assert settings.stats == {"engine": 4, "passthrough": 0}


def test_the_running_line_is_logged_once_per_patch_not_per_call(adapter, caplog):
    """The "tiled attention running" info line marks the first engine call of a patch; later calls stay quiet
    (a sampler makes thousands of attention calls)."""
    fn = adapter.make_override(adapter.PatchSettings(mode="chunked"))
    q = torch.randn(1, 4, 8)
    with caplog.at_level("INFO", logger="tiled_attention"):
        for _ in range(3):
            fn(None, q, q, q, 2)
    assert sum("tiled attention running" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("vendor, bf16, hint", [("amd", False, True), ("amd", True, False),
                                                ("nvidia", False, False), ("intel", False, False)])
def test_attention_info_hints_fp16_weights_only_on_amd_without_bf16(adapter, monkeypatch, vendor, bf16, hint):
    from tiled_attention_pack.nodes import info
    from tiled_attention_pack.attention_core.device.detection import DeviceReport
    report = DeviceReport(device="cuda:0", name="test GPU", vendor=vendor, arch=None, gfx=None, sm=None,
                          bf16_hardware=bf16)
    monkeypatch.setattr(info, "detect", lambda device: report)
    assert ("bf16: no hardware support" in info.report_text()) is hint


def test_text_encoder_fallback_is_comfys_small_input_attention(adapter):
    """With no attention passed down, the text encoder's calls fall back to ComfyUI's small-input choice (torch
    SDPA), not its large-input one (sub-quadratic on CPU)."""
    from comfy.ldm.modules import attention as comfy_attention
    from tiled_attention_pack.nodes import text_encoder_route
    seen = []
    fn = text_encoder_route.engine_attention(lambda fallback, *a, **kw: seen.append(fallback), None)
    fn(torch.zeros(1, 2, 4))
    assert seen == [comfy_attention.optimized_attention_for_device(torch.device("cpu"), small_input=True)]
    assert seen[0] is not comfy_attention.optimized_attention_for_device(torch.device("cpu"), small_input=False)


def test_clone_callbacks_are_skipped_outside_comfyui(adapter, monkeypatch):
    """clones.register does nothing (and does not raise) where comfy.patcher_extension cannot be imported."""
    import sys
    from tiled_attention_pack.nodes import clones
    monkeypatch.setitem(sys.modules, "comfy.patcher_extension", None)  # import now raises ImportError

    class Patcher:
        def add_callback_with_key(self, *a):
            raise AssertionError("registered a callback outside ComfyUI")
    assert clones.register(Patcher()) is None


def test_connectors_nested_below_the_top_level_are_found(adapter):
    """A `*embeddings_connector` anywhere on a module's path (not only the first part) marks its attention."""
    from tiled_attention_pack.nodes import connector_route

    class Attention(torch.nn.Module):
        def forward(self, x, context=None, mask=None, transformer_options={}):
            return x

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn1 = Attention()

    class Connector(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block()])

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.video_embeddings_connector = Connector()
            self.text = torch.nn.Module()
            self.text.audio_embeddings_connector = Connector()
            self.attn = Attention()  # not in a connector

    class Patcher:
        def get_model_object(self, name):
            assert name == "diffusion_model"
            return model
    model = Model()
    assert connector_route.connector_attention_modules(Patcher()) == [
        "diffusion_model.video_embeddings_connector.blocks.0.attn1",
        "diffusion_model.text.audio_embeddings_connector.blocks.0.attn1"]


# ---------------------------------------------------- the survivors of the nodes draw of seed 107200 (issue 22.11)
def test_devices_beyond_this_machines_gpus_are_named(adapter, monkeypatch):
    """A CUDA/ROCm index at or past torch.cuda.device_count() is refused naming the count; those below it, the CPU
    and an index-less 'cuda' pass (nodes/attention.py parse_devices)."""
    from tiled_attention_pack.nodes import attention
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert attention.parse_devices("Patch Attention (tiled)", "cuda:0, cuda:1, cpu, cuda") == (
        torch.device("cuda:0"), torch.device("cuda:1"), torch.device("cpu"), torch.device("cuda"))
    for name in ("cuda:2", "cuda:7"):
        with pytest.raises(ValueError, match=rf"devices lists {name}, but this machine has 2 CUDA/ROCm device"):
            attention.parse_devices("Patch Attention (tiled)", f"cuda:0, {name}")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match=r"devices lists cuda:0, but this machine has 0 CUDA/ROCm"):
        attention.parse_devices("Patch Attention (tiled)", "cuda:0")


def test_registering_again_says_whether_the_name_is_ours(adapter, monkeypatch):
    """register() on a ComfyUI with the backend registry: True when it adds the backend, True again when the name
    already holds this pack's backend, False when it holds someone else's (named otherwise, or without the
    settings this pack's carries); False without a registry (ComfyUI 0.3.75)."""
    from comfy.ldm.modules import attention
    from tiled_attention_pack.nodes import backend_registry
    registry = getattr(attention, "REGISTERED_ATTENTION_FUNCTIONS", None)
    if registry is None or not hasattr(attention, "register_attention_function"):
        assert backend_registry.register() is False
        return
    monkeypatch.setattr(attention, "REGISTERED_ATTENTION_FUNCTIONS", dict(registry))
    attention.REGISTERED_ATTENTION_FUNCTIONS.pop(backend_registry.NAME, None)
    assert backend_registry.register() is True
    registered = attention.REGISTERED_ATTENTION_FUNCTIONS[backend_registry.NAME]
    if hasattr(attention, "wrap_attn"):  # ComfyUI's own wrapper around the pack's function, as its backends are
        assert registered.__code__ is attention.wrap_attn(len).__code__, registered
        assert registered.__wrapped__.__name__ == "attention_tiled" and registered.settings is not None
    assert backend_registry.register() is True

    def attention_tiled(*args, **kwargs):
        return None
    attention.REGISTERED_ATTENTION_FUNCTIONS[backend_registry.NAME] = attention_tiled  # ours by name only
    assert backend_registry.register() is False
    attention_tiled.settings = object()
    assert backend_registry.register() is True

    def other(*args, **kwargs):
        return None
    other.settings = object()
    attention.REGISTERED_ATTENTION_FUNCTIONS[backend_registry.NAME] = other
    assert backend_registry.register() is False


def test_the_wrap_attn_search_follows_at_most_eight_wrappers_and_stops_on_a_cycle(adapter):
    """_wrap_attn_wrapper finds a wrap_attn wrapper (a closure over `func` defined in ComfyUI's attention module)
    itself or up to 7 __wrapped__ hops below what the attribute holds, not 8 (the search's bound: a cycle of
    __wrapped__ ends it too), and None for anything else."""
    import types
    from tiled_attention_pack.nodes import comfy_global_route as route

    def wrap_attn(func):
        def wrapper(*args, **kwargs):
            return func(*args, **kwargs)
        return wrapper
    inner = wrap_attn(print)
    module = types.SimpleNamespace(__file__=inner.__code__.co_filename)

    def chain(depth):
        fn = inner
        for _ in range(depth):
            fn = types.SimpleNamespace(__wrapped__=fn)
        return fn
    assert route._wrap_attn_wrapper(inner, module) is inner
    assert route._wrap_attn_wrapper(chain(7), module) is inner
    assert route._wrap_attn_wrapper(chain(8), module) is None
    cyclic = types.SimpleNamespace()
    cyclic.__wrapped__ = cyclic
    assert route._wrap_attn_wrapper(cyclic, module) is None
    assert route._wrap_attn_wrapper(print, module) is None
    for elsewhere in ("/", "elsewhere.py", inner.__code__.co_filename + "x", inner.__code__.co_filename[:-1]):
        assert route._wrap_attn_wrapper(inner, types.SimpleNamespace(__file__=elsewhere)) is None, elsewhere


def test_unroute_counts_each_cell_it_gives_back(adapter):
    """route() puts a route in each wrap_attn wrapper of this ComfyUI; unroute() gives each back and returns how
    many, once (0 the second time); none on a ComfyUI without wrap_attn (0.3.75)."""
    from tiled_attention_pack.nodes import comfy_global_route as route
    assert route.routed() == []
    names = route.route()
    try:
        assert sorted(route.routed()) == sorted(names)
    finally:
        n = route.unroute()
    assert n == len(names) and route.unroute() == 0 and route.routed() == []


def test_every_change_of_the_everywhere_mode_is_logged_once(adapter, caplog):
    """set_mode logs the new state when the mode or min_tokens changes, in either direction, and not when the same
    state is set again."""
    import logging
    from tiled_attention_pack.nodes import everywhere
    assert everywhere.state()["mode"] == "off"
    try:
        with caplog.at_level(logging.INFO):
            for mode, min_tokens in (("chunked", 0), ("auto", 0), ("auto", 0), ("auto", 64), ("auto", 8),
                                     ("online", 8), ("chunked", 8), ("off", 8), ("off", 8)):
                caplog.clear()
                before = everywhere.state()
                everywhere.set_mode(mode, min_tokens)
                lines = [r for r in caplog.records if "[tiled-attention]" in r.getMessage()]
                changed = (before["mode"], before["min_tokens"]) != (mode, min_tokens)
                assert len(lines) == changed, (mode, min_tokens, [r.getMessage() for r in lines])
                if mode != "off":  # the line says where the mode acts: auto where needed, a tier everywhere
                    where = "where this device needs it" if mode == "auto" else f"on every device, tier {mode}"
                    assert where in everywhere.describe(stats=False)
    finally:
        everywhere.set_mode("off")


def test_a_feed_forward_name_without_linear_layers_is_not_chunked(adapter):
    """find_ffn_modules keeps a block's `ffn` / `ff` / `mlp` only when it holds a Linear layer (a hidden width
    above 0): an activation or an identity under that name is not a feed-forward."""
    from tiled_attention_pack.nodes import ffn

    class Block(torch.nn.Module):
        def __init__(self, ffn_module):
            super().__init__()
            self.ffn = ffn_module
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([Block(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(),
                                                                  torch.nn.Linear(8, 4))),
                                        Block(torch.nn.GELU()), Block(torch.nn.Identity())])
    assert ffn.find_ffn_modules(model) == ["blocks.0.ffn"]


# ------------------------------------------- the survivors of a seeded nodes sample (424242, before the fresh draw)
@pytest.mark.parametrize("q_tokens, k_tokens", [(5, 9), (11, 4)])
def test_the_heads_error_asks_for_min_tokens_above_the_longer_sequence(adapter, q_tokens, k_tokens):
    """The heads error tells the user the min_tokens that keeps such calls with ComfyUI: one more than the longer
    of the query's and the key's token counts (axis -2 of [batch, tokens, width]), whichever is longer."""
    fn = adapter.make_override(adapter.PatchSettings(mode="chunked"))
    q, k = torch.randn(2, q_tokens, 12), torch.randn(2, k_tokens, 12)
    with pytest.raises(ValueError, match=rf"min_tokens to {max(q_tokens, k_tokens) + 1} or more"):
        fn(None, q, k, k, 5)


def test_devices_other_than_cuda_are_not_counted_against_the_gpus(adapter, monkeypatch):
    """Only CUDA/ROCm indexes are checked against torch.cuda.device_count(): 'cpu:3' or 'meta:1' name no GPU and
    pass however many GPUs there are (nodes/attention.py parse_devices)."""
    from tiled_attention_pack.nodes import attention
    for count in (0, 2):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        assert attention.parse_devices("Patch Attention (tiled)", "cpu:3, cpu, meta:1") == (
            torch.device("cpu:3"), torch.device("cpu"), torch.device("meta:1"))



def test_one_listed_device_runs_attention_there(adapter, monkeypatch):
    """devices with one entry (e.g. 'cuda:1' beside a model on cuda:0) is not ignored: the call goes to the head
    split with that one device, which runs it there (here the CPU, the model's device: the same answer); an empty
    list keeps the plain engine call."""
    from tiled_attention_pack.attention_core import multidevice
    from tiled_attention_pack.nodes.attention import make_settings
    real, seen = multidevice.scaled_dot_product_attention_on_devices, []

    def spy(*a, **kw):
        seen.append(tuple(kw["devices"]))
        return real(*a, **kw)
    monkeypatch.setattr(multidevice, "scaled_dot_product_attention_on_devices", spy)
    q = torch.randn(1, 6, 8)
    one = adapter.make_override(make_settings("Patch Attention (tiled)", "chunked", 0, "keep", 0, "cpu"))
    none = adapter.make_override(make_settings("Patch Attention (tiled)", "chunked", 0, "keep", 0, ""))
    out_one, out_none = one(None, q, q, q, 2), none(None, q, q, q, 2)
    assert seen == [(torch.device("cpu"),)]
    assert torch.allclose(out_one, out_none, atol=1e-6, rtol=1e-6)


def test_attention_fit_takes_a_free_memory_below_one_gb_as_given(adapter):
    """free_gb 0.5 is half a gigabyte, not 'read the free memory now' (only 0 means that): the report is
    plan.estimate's for 0.5 GB."""
    from tiled_attention_pack.nodes.fit import AttentionFit
    from tiled_attention_pack.attention_core.cli import plan
    text = AttentionFit.execute(model="wan22-5b", width=832, height=480, frames=41, dtype="fp16",
                                free_gb=0.5).result[0]
    est = plan.estimate("wan22-5b", 832, 480, 41, int(0.5 * plan.GB), 2, cpu=True, dtype="fp16")
    assert text.startswith(plan.report(est))


def test_the_heads_error_names_the_width_that_does_not_split(adapter):
    """The heads error names the last axis (the width), not the batch or token count."""
    fn = adapter.make_override(adapter.PatchSettings(mode="chunked"))
    q = torch.randn(3, 7, 12)
    with pytest.raises(ValueError, match=r"the last axis, 12, is not a multiple of 5"):
        fn(None, q, q, q, 5)


def test_comfys_default_attention_is_unknown_outside_comfyui(adapter, monkeypatch):
    """Where ComfyUI's attention module cannot be imported, the name says so instead of raising."""
    monkeypatch.setitem(sys.modules, "comfy.ldm.modules", None)  # importing it (and its attention) raises ImportError
    assert adapter.comfy_default_attention() == "unknown (ComfyUI not imported)"


def test_the_notice_names_the_graph_node_comfyui_is_executing(adapter):
    """node_label adds the id of the node ComfyUI executes ("Patch Attention (tiled) #12"), where ComfyUI has an
    executing context (0.3.4x on), and is the bare name outside one."""
    from tiled_attention_pack.nodes.override_notice import node_label
    utils = sys.modules.get("comfy_execution.utils") or importlib.import_module("comfy_execution.utils")
    if not hasattr(utils, "CurrentNodeContext"):
        pytest.skip("not applicable: this ComfyUI has no executing context (0.3.75)")
    assert node_label("Patch Attention (tiled)") == "Patch Attention (tiled)"
    with utils.CurrentNodeContext("prompt-1", "12"):
        assert node_label("Patch Attention (tiled)") == "Patch Attention (tiled) #12"


def test_attention_fit_reads_its_dtype_from_a_prompts_json(adapter):
    """The dtype arrives as a string parsed from the prompt's JSON (not the interned literal of the schema): 'fp32'
    from json.loads still counts 4 bytes an element ('==', not 'is'), the other dtypes 2."""
    import json
    from tiled_attention_pack.nodes.fit import AttentionFit
    from tiled_attention_pack.attention_core.cli import plan
    inputs = json.loads('{"model": "wan22-5b", "width": 832, "height": 480, "frames": 41, "dtype": "fp32", '
                        '"free_gb": 8.0}')
    assert inputs["dtype"] is not "fp32"  # noqa: F632 - the point: another object with the same text
    text = AttentionFit.execute(**inputs).result[0]
    est = plan.estimate("wan22-5b", 832, 480, 41, int(8.0 * plan.GB), 4, cpu=True, dtype="fp32")
    assert text.startswith(plan.report(est))
    assert est != plan.estimate("wan22-5b", 832, 480, 41, int(8.0 * plan.GB), 2, cpu=True, dtype="fp32")


def test_patch_settings_count_compiled_calls_as_a_number(adapter):
    """PatchSettings.compiled_calls is a number (a property: 0 for eager calls), beside stats['engine']."""
    settings = adapter.PatchSettings(mode="chunked")
    q = torch.randn(1, 6, 8)
    assert settings.compiled_calls == 0 and settings.stats["engine"] == 0
    adapter.make_override(settings)(None, q, q, q, 2)
    assert settings.stats["engine"] == 1 and settings.compiled_calls == 0
    assert isinstance(settings.compiled_calls, int)


@pytest.mark.parametrize("value", ["auto", "chunked", "inplace", "online"])
def test_every_on_value_of_the_environment_switches_the_mode_on(adapter, monkeypatch, value):
    """TILED_ATTENTION_EVERYWHERE=auto / chunked / inplace / online at start turns the mode on in that mode, set by
    the variable; 'off' leaves it off."""
    from tiled_attention_pack.nodes import everywhere
    monkeypatch.setattr(everywhere, "_env_applied", False)
    try:
        s = everywhere.apply_environment({everywhere.ENV: value})
        assert s["on"] and s["mode"] == value and s["source"] == f"{everywhere.ENV}={value}", s
    finally:
        everywhere.set_mode("off")
    monkeypatch.setattr(everywhere, "_env_applied", False)
    assert not everywhere.apply_environment({everywhere.ENV: "off"})["on"]


def test_the_environment_is_applied_by_the_first_call_of_a_fresh_process(adapter, caplog):
    """A freshly imported nodes/everywhere.py has not applied TILED_ATTENTION_EVERYWHERE yet: its first
    apply_environment() reads the variable (an invalid value is logged as an error), later calls change nothing.
    A second copy of the module (its own state; siblings shared) stands in for a fresh process."""
    import importlib.util
    import logging
    from tiled_attention_pack.nodes import everywhere
    spec = importlib.util.spec_from_file_location("tiled_attention_pack.nodes._everywhere_fresh", everywhere.__file__)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    with caplog.at_level(logging.ERROR, logger="tiled_attention"):
        assert not fresh.apply_environment({fresh.ENV: "sometimes"})["on"]
        assert [r for r in caplog.records if "is not a mode" in r.getMessage()], caplog.text
        caplog.clear()
        assert not fresh.apply_environment({fresh.ENV: "sometimes"})["on"]
        assert not caplog.records, caplog.text  # once per process


@pytest.mark.parametrize("bad", [True, False, 3.5, -1, "7", None])
def test_set_mode_refuses_a_min_tokens_that_is_not_a_whole_number_and_changes_nothing(adapter, bad):
    """min_tokens must be an int >= 0 (a bool is not one, though Python counts it as an int): anything else is a
    ValueError naming the node and the value, and the mode stays as it was."""
    from tiled_attention_pack.nodes import everywhere
    before = everywhere.state()
    with pytest.raises(ValueError, match=r"Tiled Attention Everywhere: min_tokens must be a whole number >= 0, got "):
        everywhere.set_mode("chunked", bad)
    after = everywhere.state()
    assert {k: after[k] for k in ("mode", "set", "min_tokens", "on")} == \
        {k: before[k] for k in ("mode", "set", "min_tokens", "on")}


def test_an_invalid_value_is_echoed_to_forty_characters(adapter):
    """everywhere.shown echoes at most SHOWN_CHARS = 40 characters of a value, then says how long it was."""
    from tiled_attention_pack.nodes import everywhere
    assert everywhere.shown("x" * 40) == repr("x" * 40)
    assert everywhere.shown("x" * 41) == repr("x" * 40) + "... (41 characters)"
    assert everywhere.shown("a\x00b") == repr("a?b")


def test_patch_settings_stats_has_two_keys_only(adapter):
    """stats is a mapping of exactly 'engine' and 'passthrough': any other key is a KeyError (not the engine
    count), so `in` and .get() answer as for a dict."""
    stats = adapter.PatchSettings(mode="chunked").stats
    assert dict(stats) == {"engine": 0, "passthrough": 0}
    for key in ("compiled", "aaa", "zzz", ""):
        with pytest.raises(KeyError):
            stats[key]
        assert key not in stats and stats.get(key) is None


def test_settings_compare_by_their_options_not_by_their_counts(adapter):
    """Two Patch Attention settings with the same options are equal whatever each has counted (a count is a
    record of calls, not an option: ComfyUI compares model options to decide what to re-run)."""
    a, b = adapter.PatchSettings(mode="chunked"), adapter.PatchSettings(mode="chunked")
    a.counted["engine"] += 3
    a.counted["passthrough"] += 1
    assert a == b and a.count_key != b.count_key
    assert a != adapter.PatchSettings(mode="online")


def test_auto_asks_the_device_whatever_string_object_holds_the_mode(adapter, monkeypatch):
    """The mode from a workflow is a string read from JSON, not the literal "auto" of the code: auto is recognised
    by value (a device with fused attention then keeps ComfyUI's attention)."""
    mode = "".join(["au", "to"])
    assert mode == "auto" and mode is not "auto"  # noqa: F632  (the point: equal, not the same object)
    asked = []
    monkeypatch.setattr(adapter, "_needs_tiled_attention", lambda device: asked.append(device) or False)
    q = torch.zeros(1, 2, 4)
    assert adapter.wants_engine(adapter.PatchSettings(mode=mode), q, 4096, 4096) is False
    assert asked == [q.device]


def test_only_the_innermost_modules_that_take_the_parameter_are_routed(adapter):
    """leaf_modules_with_parameter: a root (name "") or block whose forward takes the parameter only to pass it
    down is left out when a submodule takes it too; a root that alone takes it is the one."""
    from tiled_attention_pack.nodes import object_routes

    class Attn(torch.nn.Module):
        def forward(self, x, transformer_options=None):
            return x

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attn()

        def forward(self, x, transformer_options=None):
            return self.attn(x, transformer_options)

    class Root(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(), Block()])

        def forward(self, x, transformer_options=None):
            return x

    found = object_routes.leaf_modules_with_parameter(Root(), "transformer_options")
    assert found == ["blocks.0.attn", "blocks.1.attn"], found
    assert object_routes.leaf_modules_with_parameter(Attn(), "transformer_options") == [""]


def test_the_heads_error_for_zero_heads_asks_for_one(adapter):
    """heads=0 is not 'a width that is not a multiple of 0': the error says there must be at least one head."""
    fn = adapter.make_override(adapter.PatchSettings(mode="chunked"))
    q = torch.randn(1, 5, 12)
    with pytest.raises(ValueError, match=r"and there must be at least one head\."):
        fn(None, q, q, q, 0)


def test_attention_fit_on_a_gpu_counts_the_gpus_buffers(adapter, monkeypatch):
    """On a GPU (the device name a runtime string, as torch gives it) Attention Fit plans with the GPU's rules
    (cpu=False: chunked keeps a second score buffer there), on the CPU with the CPU's."""
    from tiled_attention_pack.nodes import fit
    from tiled_attention_pack.attention_core.cli import plan
    args = dict(model="wan22-5b", width=832, height=480, frames=41, dtype="fp16", free_gb=2.0)
    monkeypatch.setattr(plan, "time_report", lambda est, device, blocks=None: "time")  # no GPU to name here
    for device, cpu in (("cuda:0", False), ("cpu", True)):
        name = "".join(list(device))  # not the interned literal
        monkeypatch.setattr(fit, "device_here", lambda: name)
        text = fit.AttentionFit.execute(**args).result[0]
        est = plan.estimate("wan22-5b", 832, 480, 41, int(2.0 * plan.GB), 2, cpu=cpu, dtype="fp16")
        assert text.startswith(plan.report(est) + "\n\n"), device


def test_one_head_is_a_valid_head_count(adapter):
    """heads=1 (a single-head attention on [batch, tokens, width]) runs, as torch's SDPA on one head."""
    fn = adapter.make_override(adapter.PatchSettings(mode="chunked"))
    q, k, v = (torch.randn(2, 7, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    out = fn(None, q, k, v, 1)
    ref = F.scaled_dot_product_attention(q[:, None].double(), k[:, None].double(), v[:, None].double())[:, 0]
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_the_backend_is_not_registered_outside_comfyui(adapter, monkeypatch):
    """Where ComfyUI's attention module cannot be imported, register() says the name is not ours (False)."""
    from tiled_attention_pack.nodes import backend_registry
    monkeypatch.setitem(sys.modules, "comfy.ldm.modules", None)  # importing it raises ImportError
    assert backend_registry.register() is False


def test_attention_info_outside_comfyui_falls_back_to_torchs_device(adapter, monkeypatch):
    """Where comfy.model_management cannot be imported, Attention Info's device is torch's own choice (the CPU on
    a machine without CUDA) instead of an error. Fresh draw 247072's survivor (written after the draw)."""
    from tiled_attention_pack.nodes import info
    monkeypatch.setitem(sys.modules, "comfy.model_management", None)  # importing it raises ImportError
    assert info._device() == torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_rebinding_leaves_an_object_with_rewrapped_but_no_wraps_alone(adapter):
    """_rebound rebinds this pack's wrappers only (a class with WRAPS and a rewrapped method): another object that
    merely has a `rewrapped` attribute is kept as it is. Fresh draw 247072's survivor (written after the draw)."""
    from tiled_attention_pack.nodes import clones

    class Foreign:
        def rewrapped(self, inner):
            raise AssertionError("not ours to rewrap")
    obj = Foreign()
    assert clones._rebound(obj, {}, torch.nn.Module(), "key") is obj


def test_the_vae_route_compiles_without_a_graph_break(adapter):
    """Patch Attention (VAE)'s route under torch.compile(fullgraph=True): the first-call log is not reached while
    tracing (count() gives 0 there, and only the first eager call logs). Fresh draw 247072's survivor
    (count == 1 as <= 1 logged inside the trace), written after the draw."""
    from tiled_attention_pack.nodes.vae_route import VaeAttentionRoute
    settings = adapter.PatchSettings(mode="chunked", node="Patch Attention (VAE)")
    route = VaeAttentionRoute(lambda q, k, v: q, settings)
    q, k, v = (torch.randn(1, 8, 2, 4, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    import torch._dynamo as dynamo
    dynamo.reset()
    try:
        out = torch.compile(route, backend="eager", fullgraph=True)(q, k, v)
    finally:
        dynamo.reset()
    assert torch.allclose(out, route(q, k, v), atol=1e-6)


def test_attention_info_is_never_cached(adapter):
    """Attention Info describes the machine now: its fingerprint is NaN (never equal to itself), asked of the class
    as ComfyUI's executor asks it, so every prompt runs it again."""
    import math
    from tiled_attention_pack.nodes.info import AttentionInfo
    first, second = AttentionInfo.fingerprint_inputs(), AttentionInfo.fingerprint_inputs()
    assert math.isnan(first) and first != second


def test_the_vae_routes_running_line_comes_with_its_first_engine_call(adapter, caplog):
    """Patch Attention (VAE)'s "tiled attention running" line is logged at the first call the engine takes, once."""
    from tiled_attention_pack.nodes.vae_route import VaeAttentionRoute
    route = VaeAttentionRoute(lambda q, k, v: None, adapter.PatchSettings(mode="chunked", node="Patch Attention (VAE)"))
    q = torch.randn(1, 4, 2, 3)  # ComfyUI's VAE layout [B, C, H, W]
    with caplog.at_level("INFO", logger="tiled_attention"):
        route(q, q, q)
        assert sum("tiled attention running" in r.getMessage() for r in caplog.records) == 1
        route(q, q, q)
    assert sum("tiled attention running" in r.getMessage() for r in caplog.records) == 1


def test_ffn_modules_are_found_inside_blocks_only():
    """A feed-forward module at the model's top level (no dot in its path) is not a block's FFN; the blocks' are."""
    load_pack()
    from tiled_attention_pack.nodes.ffn import find_ffn_modules

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ffn = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = torch.nn.Linear(4, 4)  # top level: not a block's
            self.blocks = torch.nn.ModuleList([Block(), Block()])
    assert find_ffn_modules(Model()) == ["blocks.0.ffn", "blocks.1.ffn"]

"""Tiled Attention Everywhere (the process-wide mode) inside a real ComfyUI (0.33.0 in-process; 0.3.75 through
tests/comfy/test_inprocess_on_oldest.py), on model code nobody here wrote: a tiny diffusers WanTransformer3DModel
and WanVideoWrapper-style attention blocks (tools/fixtures/wrapper_pack_standin), ComfyUI's global attention functions,
the native Wan 2.2 model with Patch Attention, the UMT5 text encoder and the Wan 2.2 VAE.

Routed / total calls come from attention_core.patch.stats() of the pack as ComfyUI loads it; the stand-ins count
their own attention calls (module forwards), independently of the pack. Outputs with the mode on are compared with
the mode off and with a float64 run of the same model; memory with LiveBytes under torch's math SDPA (the only
backend on the GPUs the pack is for)."""
import asyncio
import contextlib
import sys
import threading

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from comfy_harness import PACK_NAME, load_tiny, require_comfy
from live_bytes import peak_bytes

pytestmark = pytest.mark.comfy_inprocess  # run again against 0.3.75 by test_inprocess_on_oldest.py
TORCH_SDPA = F.scaled_dot_product_attention


def mod(name):
    return sys.modules[f"{PACK_NAME}.{name}"]


@pytest.fixture
def ew(pack, monkeypatch):
    """The pack's nodes.everywhere, off before and after the test (and torch's SDPA and ComfyUI's functions back)."""
    everywhere, patch = mod("nodes.everywhere"), mod("attention_core.patch")
    monkeypatch.delenv("TILED_ATTENTION", raising=False)
    assert everywhere.state()["mode"] == "off" and F.scaled_dot_product_attention is TORCH_SDPA
    patch.reset_stats()
    yield everywhere
    everywhere.set_mode("off")
    assert F.scaled_dot_product_attention is TORCH_SDPA and not patch.is_enabled()
    assert mod("nodes.comfy_global_route").routed() == []


@pytest.fixture(scope="module")
def standin(pack):
    require_comfy()
    import tools.fixtures.wrapper_pack_standin as s
    return s


def stats(path):
    return mod("attention_core.patch").stats().get(path, {"routed": 0, "passed": 0, "deferred": 0, "total": 0,
                                                          "compiled": 0})


def report(what, routed, total):
    """The measured routed / total calls of a code path (pytest -s shows them; the README's table)."""
    from tools.comfyui_setup.comfyui import inprocess_version
    print(f"\nComfyUI {inprocess_version()}, {what}: {routed} of {total} attention calls routed")


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def node(pack, node_id):
    nodes = asyncio.run(asyncio.run(pack.comfy_entrypoint()).get_node_list())
    return {n.GET_SCHEMA().node_id: n for n in nodes}[node_id]


# --- the switch: environment variable, node, start line, Attention Info -------------------------------------------

def test_environment_variable_values(ew):
    for off in (None, "", "0", " off "):
        assert ew.parse_env(off) == "off"
    for mode in ("auto", "chunked", "online", "inplace"):
        assert ew.parse_env(f" {mode.upper()} ") == mode
    for bad in ("1", "yes", "tiled", "on"):
        with pytest.raises(ValueError, match="TILED_ATTENTION_EVERYWHERE=.*0 \\(off\\), auto"):
            ew.parse_env(bad)


def test_environment_applies_once_at_load_and_start_line_shows_it(pack, ew, monkeypatch, caplog):
    monkeypatch.setattr(ew, "_env_applied", False)
    monkeypatch.setenv(ew.ENV, "online")
    caplog.set_level("INFO", logger="tiled_attention")
    asyncio.run(pack.comfy_entrypoint())  # what ComfyUI's loader calls once at start
    assert ew.state()["mode"] == "online" and F.scaled_dot_product_attention is not TORCH_SDPA
    line = [r.getMessage() for r in caplog.records if "Tiled Attention Everywhere" in r.getMessage()][-1]
    assert "ON, process-wide (mode online, set by TILED_ATTENTION_EVERYWHERE=online)" in line, line
    monkeypatch.setenv(ew.ENV, "chunked")
    asyncio.run(pack.comfy_entrypoint())  # a second load changes nothing
    assert ew.state()["mode"] == "online"
    ew.set_mode("off")
    monkeypatch.setattr(ew, "_env_applied", False)
    monkeypatch.setenv(ew.ENV, "yes")
    caplog.clear()
    asyncio.run(pack.comfy_entrypoint())
    assert ew.state()["mode"] == "off"
    assert any(r.levelname == "ERROR" and "TILED_ATTENTION_EVERYWHERE='yes'" in r.getMessage()
               for r in caplog.records)
    assert "Tiled Attention Everywhere: off" in mod("nodes.info").startup_line()


def test_node_switches_passes_value_and_reports(pack, ew):
    everywhere_node = node(pack, "TiledAttentionEverywhere")
    everywhere_node.GET_SCHEMA().validate()  # what ComfyUI's loader checks (unique ids, ...)
    info = everywhere_node.GET_NODE_INFO_V1()
    for name, spec in info["input"]["required"].items():
        assert spec[1].get("tooltip"), name
    thing = object()
    out = everywhere_node.execute("inplace", 0, thing)
    assert out[0] is thing and "mode inplace" in out[1] and out.ui["text"] == [out[1]]
    assert ew.state()["mode"] == "inplace" and mod("nodes.comfy_global_route").routed()
    report = node(pack, "TiledAttentionInfo").execute()[0]
    assert "Tiled Attention Everywhere: ON" in report
    out = everywhere_node.execute("off", 1024, None)
    assert "Tiled Attention Everywhere: off" in out[1] and F.scaled_dot_product_attention is TORCH_SDPA
    with pytest.raises(ValueError, match="Tiled Attention Everywhere: mode must be one of"):
        everywhere_node.execute("fast", 0, None)


# --- packs with their own model code --------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["chunked", "auto"])
def test_diffusers_wan_every_call_routed_and_exact(ew, standin, mode, monkeypatch):
    engine = engine_calls(monkeypatch)
    if mode == "auto":
        monkeypatch.setenv("TILED_ATTENTION", "force")  # the CPU has a fused backend; force the device verdict
    args = (3, 2, 8, 8)  # seed, frames, height, width: 32 tokens
    off, calls = standin.run_diffusers_wan(*args)
    assert calls == 4  # 2 blocks x (self + cross attention)
    ref, _ = standin.run_diffusers_wan(*args, dtype=torch.float64)
    assert stats("torch_sdpa")["total"] == 0  # off: nothing seen, nothing routed
    report("diffusers Wan, mode off", 0, calls)
    ew.set_mode(mode, 0)
    on, calls_on = standin.run_diffusers_wan(*args)
    s = stats("torch_sdpa")
    assert calls_on == calls and s["routed"] == s["total"] == calls, s
    assert engine[0] == calls  # the engine computed each of them
    report(f"diffusers Wan, mode {mode}", s["routed"], calls)
    torch_err, engine_err = rel(off, ref), rel(on, ref)
    assert engine_err <= 8 * torch_err + 1e-6, (engine_err, torch_err)
    assert rel(on, off) < 1e-5
    ew.set_mode("off")
    again, _ = standin.run_diffusers_wan(*args)
    assert stats("torch_sdpa") == s and torch.equal(again, off)


def test_auto_leaves_devices_with_fused_attention_alone(ew, standin, monkeypatch):
    monkeypatch.setenv("TILED_ATTENTION", "off")
    ew.set_mode("auto", 0)
    _, calls = standin.run_diffusers_wan(3, 2, 8, 8)
    assert stats("torch_sdpa") == {"routed": 0, "passed": calls, "deferred": 0, "total": calls, "compiled": 0}


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_wrapper_sdpa_convention_every_call_routed_and_exact(ew, standin, dtype, monkeypatch):
    engine = engine_calls(monkeypatch)
    half = standin.DTYPES[dtype]
    off, calls = standin.run_wrapper_model(1, 64, "sdpa", half)
    ref, _ = standin.run_wrapper_model(1, 64, "sdpa", torch.float64)
    ew.set_mode("chunked", 0)
    on, _ = standin.run_wrapper_model(1, 64, "sdpa", half)
    s = stats("torch_sdpa")
    report(f"WanVideoWrapper-style sdpa ({dtype}), mode chunked", s["routed"], calls)
    assert engine[0] == calls
    assert calls == 4 and s["routed"] == s["total"] == calls, s
    eps = torch.finfo(half).eps
    assert rel(on, ref) <= 2 * rel(off, ref) + eps, (rel(on, ref), rel(off, ref))
    if half == torch.float32:
        assert rel(on, off) < 1e-5


# WanVideoWrapper's sampler runs its model under torch.autocast(device, dtype=base precision) (fp8 weights); until 2025
# its "sdpa" cast q, k, v to bf16 first, since then they stay in the model's dtype (Lynx passes a key-padding mask).
# torch.autocast refuses float32 on the CPU (off) but CUDA takes it: that state is set directly for the last case.
WRAPPER_AUTOCAST = {
    "fp16 base, autocast, sdpa cast to bf16": dict(base_precision="fp16", autocast=True,
                                                   attention_dtype=torch.bfloat16),
    "bf16 base, autocast, sdpa in the model dtype, masked": dict(base_precision="bf16", autocast=True,
                                                                 attention_dtype=None, attn_mask=True),
    "fp16 base, autocast, sdpa in the model dtype": dict(base_precision="fp16", autocast=True, attention_dtype=None),
    "fp32 base, autocast refused by the CPU, sdpa cast to bf16": dict(base_precision="fp32", autocast=True,
                                                                      attention_dtype=torch.bfloat16),
    "fp32 base under CUDA's float32 autocast, sdpa cast to bf16": dict(base_precision="fp32",
                                                                       attention_dtype=torch.bfloat16,
                                                                       state=("cpu", torch.float32)),
}


@pytest.mark.parametrize("case", list(WRAPPER_AUTOCAST))
def test_wrapper_sampler_under_autocast_dtype_and_error_as_torch(ew, standin, case, monkeypatch):
    """The process-wide mode on the stand-in's sampler as WanVideoWrapper runs it under autocast: every call routed,
    each attention call returns torch's dtype (the mode off: torch's SDPA under the same autocast) and the output's
    error against a float64 run stays within 2x torch's. Red before (the engine cast fp32 inputs only): bf16 q, k, v
    under an fp16 autocast came back bf16, under CUDA's float32 autocast bf16 (torch: fp32)."""
    from autocast_states import autocast_state
    engine = engine_calls(monkeypatch)
    kw = dict(WRAPPER_AUTOCAST[case])
    state = kw.pop("state", None)

    def run():
        model = standin.tiny_wrapper_model(11)
        with autocast_state(*state) if state else contextlib.nullcontext():
            out, calls = standin.run_wrapper_model(11, 64, "sdpa", model=model, **kw)
        return out, calls, model.attention_dtypes()
    off, calls, off_dtypes = run()
    ref, _ = standin.run_wrapper_model(11, 64, "sdpa", None if kw["attention_dtype"] is None else torch.float64,
                                       base_precision=torch.float64, attn_mask=kw.get("attn_mask", False))
    ew.set_mode("chunked", 0)
    on, _, on_dtypes = run()
    s = stats("torch_sdpa")
    report(f"WanVideoWrapper-style sampler, {case}, mode chunked", s["routed"], calls)
    assert calls == 4 and s["routed"] == s["total"] == calls == engine[0], s
    assert on_dtypes == off_dtypes and len(on_dtypes) == 1, (on_dtypes, off_dtypes)
    if state:
        assert on_dtypes == ["float32"]
    assert rel(on, ref) <= 2 * rel(off, ref) + 1e-6 and rel(off, ref) < 0.1, (rel(on, ref), rel(off, ref))


@pytest.mark.parametrize("compile_", ["transformer_blocks", "full_model"])
def test_wrapper_compile_option_under_the_mode(ew, standin, compile_):
    """The stand-in's torch.compile option (WanVideoWrapper's: blocks or the whole model, here the aot_eager
    backend) with the mode on, under a bf16 autocast: the compiled model's attention goes to the engine inside
    the graph, its output as the eager run's with the mode on, as close to float64 as torch's."""
    kw = dict(base_precision="bf16", autocast=True, attention_dtype=None)
    off, calls = standin.run_wrapper_model(12, 48, "sdpa", **kw)
    ref, _ = standin.run_wrapper_model(12, 48, "sdpa", None, base_precision=torch.float64)
    ew.set_mode("chunked", 0)
    eager, _ = standin.run_wrapper_model(12, 48, "sdpa", **kw)
    compiled, compiled_calls = standin.run_wrapper_model(12, 48, "sdpa", compile=compile_, backend="aot_eager", **kw)
    assert compiled_calls == calls == 4 and compiled.dtype == eager.dtype == torch.bfloat16
    assert rel(compiled, eager) <= 2 * torch.finfo(torch.bfloat16).eps
    assert rel(compiled, ref) <= 2 * rel(off, ref) + 1e-6


def test_min_tokens_floor_and_inputs_torch_keeps(ew, standin):
    ew.set_mode("chunked", 65)  # the longer sequence of every call is 64 tokens
    standin.run_wrapper_model(1, 64, "sdpa", torch.float32)
    assert stats("torch_sdpa") == {"routed": 0, "passed": 4, "deferred": 0, "total": 4, "compiled": 0}
    ew.set_mode("chunked", 64)
    standin.run_wrapper_model(1, 64, "sdpa", torch.float32)
    assert stats("torch_sdpa")["routed"] == 4
    ints = torch.ones(1, 2, 8, 4, dtype=torch.int64)
    with pytest.raises(Exception) as theirs:
        TORCH_SDPA(ints, ints, ints)
    with pytest.raises(type(theirs.value)) as ours:
        F.scaled_dot_product_attention(ints, ints, ints)
    assert str(ours.value) == str(theirs.value)  # torch's own error: the call went to torch


def test_comfy_global_attention_routed_everywhere_it_is_held_and_restored(ew, standin, monkeypatch):
    engine = engine_calls(monkeypatch)
    import comfy.ldm.modules.attention as attention
    import comfy.ldm.wan.model as wan_model
    route = mod("nodes.comfy_global_route")
    before = [(name, cell, cell.cell_contents) for name, _, cell in route._wrappers()]
    assert {"optimized_attention", "attention_basic", "attention_pytorch"} <= {n for n, _, _ in before}
    off, calls = standin.run_wrapper_model(2, 48, "comfy", torch.float32)
    ew.set_mode("chunked", 0)
    on, _ = standin.run_wrapper_model(2, 48, "comfy", torch.float32)
    s = stats("comfy_attention")
    report("WanVideoWrapper-style 'comfy' mode (global optimized_attention), mode chunked", s["routed"], calls)
    assert engine[0] == calls
    assert calls == 4 and s["routed"] == s["total"] == calls, s
    assert rel(on, off) < 1e-5
    # the same wrapper, however a module holds it: by name (Wan), by attribute, handed out per device
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, 32, generator=g) for _ in range(3))
    for fn in (wan_model.optimized_attention, attention.optimized_attention,
               attention.optimized_attention_for_device(torch.device("cpu")),
               attention.optimized_attention_for_device(torch.device("cpu"), small_input=True)):
        n = stats("comfy_attention")["routed"]
        out = fn(q, k, v, 4)
        assert stats("comfy_attention")["routed"] == n + 1, fn
        assert engine[0] == n + 1, fn  # the engine computed it
        want = TORCH_SDPA(*(t.view(1, 40, 4, 8).transpose(1, 2).double() for t in (q, k, v)))
        assert (out.double() - want.transpose(1, 2).reshape(1, 40, 32)).abs().max() < 1e-5
    ew.set_mode("off")
    assert all(cell.cell_contents is fn for _, cell, fn in before)  # exactly what was there


def test_attention_memory_is_linear_in_tokens(ew, standin, monkeypatch):
    """Under torch's math SDPA (all the GPUs the pack is for have), the diffusers Wan holds the N x N scores of
    every head with the mode off; with it on its attention holds O(N). The engine's op is called directly so that
    LiveBytes sees its tiles."""
    autograd = mod("attention_core.kernel.autograd")

    def fwd_visible(*args):  # the op's arguments, ending with need_stats and count_as
        seed = args[4]
        mod("attention_core.kernel.counts").add(args[16])
        return autograd.forward_canonical(*args[:4], int(seed.item()) if seed is not None else 0, *args[5:16])
    monkeypatch.setattr(autograd, "attention_fwd", fwd_visible)

    def peak(frames):
        with sdpa_kernel([SDPBackend.MATH]):
            return peak_bytes(standin.run_diffusers_wan, 5, frames, 64, 64)
    scores = 2 * 4096 ** 2 * 4  # 2 heads x N^2 fp32 at N = 4 frames x 32 x 32 = 4096 tokens
    math_peak = peak(4)
    ew.set_mode("chunked", 0)
    small, large = peak(2), peak(4)
    assert stats("torch_sdpa")["routed"] == 8
    print(f"\nLiveBytes peak of the diffusers Wan, math SDPA: mode off {math_peak / 2 ** 20:.1f} MiB at 4096 tokens; "
          f"mode chunked {small / 2 ** 20:.1f} MiB at 2048, {large / 2 ** 20:.1f} MiB at 4096 (scores: {scores / 2 ** 20:.0f} MiB)")
    assert math_peak >= scores, math_peak
    assert large <= scores / 4, (large, scores)
    assert large <= 2.5 * small, (small, large)  # doubling N at most ~doubles the peak: O(N), not O(N^2)


# --- ComfyUI's own models: Patch Attention keeps its models, the mode takes the rest -----------------------------

@pytest.fixture(scope="module")
def wan(tmp_path_factory, pack):
    from tools.fixtures.tiny_models import write_wan22_5b
    return load_tiny(tmp_path_factory, write_wan22_5b, "wan22_tiny.safetensors", "WAN22_T2V")


def sample(model, steps=1):
    import nodes
    g = torch.Generator().manual_seed(1)
    latent, cond = torch.randn(1, 48, 3, 16, 16, generator=g), torch.randn(1, 12, 4096, generator=g)
    return nodes.KSampler().sample(model, 0, steps, 3.0, "euler", "simple", [[cond, {}]],
                                   [[torch.zeros_like(cond), {}]], {"samples": latent})[0]["samples"]


def patch_node(pack, model, min_tokens):
    m = node(pack, "TiledAttentionPatch").execute(model, "chunked", 0, "keep", min_tokens)[0]
    return m, m.model_options["transformer_options"]["optimized_attention_override"]._tiled_attention.stats


def engine_calls(monkeypatch):
    """Every engine call, whichever route made it (the per-model override, the global route, the SDPA patch)."""
    calls = [0]
    for name in ("attention_core.sdpa", "nodes.comfy_adapter"):
        m = mod(name)
        real = m.scaled_dot_product_attention

        def counted(*a, _real=real, **k):
            calls[0] += 1
            return _real(*a, **k)
        monkeypatch.setattr(m, "scaled_dot_product_attention", counted)
    return calls


def test_native_wan_patch_attention_settings_win_and_no_call_routed_twice(pack, ew, wan, monkeypatch):
    ref = sample(wan)
    engine = engine_calls(monkeypatch)
    ew.set_mode("chunked", 0)
    # the node passes every call on (min_tokens): the mode must not take them
    passing, node_stats = patch_node(pack, wan, 10 ** 6)
    out = sample(passing)
    s = stats("comfy_attention")
    assert node_stats["engine"] == 0 and node_stats["passthrough"] > 0
    assert s["deferred"] == node_stats["passthrough"] and s["routed"] == 0 and engine[0] == 0, s
    report("native Wan, Patch Attention passing every call on (min_tokens 10^6), mode chunked: by the mode",
           s["routed"], node_stats["passthrough"])
    assert rel(out, ref) < 1e-4
    # the node routes every call: once each, by the node
    mod("attention_core.patch").reset_stats()
    routing, node_stats = patch_node(pack, wan, 0)
    out = sample(routing)
    assert node_stats["engine"] > 0 and engine[0] == node_stats["engine"]
    report("native Wan, Patch Attention chunked min_tokens 0, mode chunked: by the node (the mode saw "
           f"{stats('comfy_attention')['total']})", node_stats["engine"], engine[0])
    assert stats("comfy_attention")["total"] == 0 and stats("torch_sdpa")["total"] == 0
    assert rel(out, ref) < 1e-4
    # the same model without the node: the mode routes it
    mod("attention_core.patch").reset_stats()
    engine[0] = 0
    out = sample(wan)
    s = stats("comfy_attention")
    assert s["routed"] == s["total"] == node_stats["engine"] == engine[0], s
    report("native Wan without Patch Attention, mode chunked", s["routed"], s["total"])
    assert rel(out, ref) < 1e-4


def test_text_encoder_and_vae_paths(pack, ew, tmp_path_factory, monkeypatch):
    """UMT5 (ComfyUI's small-input attention_basic) is routed by the mode; the Wan VAE's blocks hold ComfyUI's
    plain normal_attention (the CPU's and AMD's VAE attention): the mode cannot reach it (Patch Attention (VAE)
    does); with pytorch VAE attention (pytorch_attention, torch SDPA) the mode routes it."""
    engine = engine_calls(monkeypatch)
    import comfy.ldm.modules.diffusionmodules.model as vae_model
    import comfy.sd
    import comfy.utils
    import tools.fixtures.tiny_model_loaders  # noqa: F401 - the tiny sizes reach the stock loaders
    from attention_calls import count_comfy_attention
    from tools.fixtures.tiny_models import write_umt5, write_wan22_vae
    base = tmp_path_factory.mktemp("te_vae")
    clip = comfy.sd.load_clip(ckpt_paths=[write_umt5(str(base / "umt5.safetensors"))],
                              clip_type=comfy.sd.CLIPType.WAN)
    with count_comfy_attention() as counts:
        vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(write_wan22_vae(str(base / "vae.safetensors"))))

        def encode(c):
            return c.encode_from_tokens_scheduled(c.tokenize("a cat sitting on a mat"))[0][0]
        latent = torch.randn(1, 48, 2, 4, 4, generator=torch.Generator().manual_seed(0))
        ref_te = encode(clip)
        with torch.no_grad():
            ref_vae = vae.decode(latent)
        vae_calls = counts.by_function.get("vae.normal_attention", 0)
        assert vae_calls >= 2, counts.by_function
        ew.set_mode("chunked", 0)
        out_te = encode(clip)
        s = stats("comfy_attention")
        assert s["routed"] == s["total"] == 2, s  # 2 UMT5 layers
        assert engine[0] == 2
        engine[0] = 0
        report("UMT5 text encoder (attention_basic), mode chunked", s["routed"], s["total"])
        assert rel(out_te, ref_te) < 1e-4
        counts.reset()
        with torch.no_grad():
            out_vae = vae.decode(latent)
        assert counts.by_function.get("vae.normal_attention", 0) == vae_calls  # not reached by the mode
        report("Wan 2.2 VAE on normal_attention, mode chunked", stats("torch_sdpa")["routed"], vae_calls)
        assert stats("torch_sdpa")["total"] == 0 and torch.equal(out_vae, ref_vae)
        # the same blocks on pytorch VAE attention (ComfyUI's choice where pytorch attention is enabled)
        blocks = [m for m in vae.first_stage_model.modules() if m.__dict__.get("optimized_attention") is not None]
        for m in blocks:
            m.optimized_attention = vae_model.pytorch_attention
        with torch.no_grad():
            out_sdpa = vae.decode(latent)
        s = stats("torch_sdpa")
        assert s["routed"] == s["total"] == vae_calls == engine[0], (s, engine)
        report("Wan 2.2 VAE on pytorch_attention (torch SDPA), mode chunked", s["routed"], vae_calls)
        assert rel(out_sdpa, ref_vae) < 1e-4


# --- switching while another prompt runs ----------------------------------------------------------------------

def test_switching_while_other_threads_run_models_corrupts_nothing(pack, ew, standin, wan):
    # models built here: building draws no global random numbers, but a sampler in another thread would
    dmodel, wmodel = standin.tiny_diffusers_wan(7), standin.tiny_wrapper_model(7)
    diffusers_ref, _ = standin.run_diffusers_wan(7, 2, 8, 8, model=dmodel)
    wrapper_ref, _ = standin.run_wrapper_model(7, 64, "sdpa", torch.float32, model=wmodel)
    wan_ref = sample(wan)
    patched, node_stats = patch_node(pack, wan, 0)
    errors, stop = [], threading.Event()

    def guard(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                stop.set()
        return run

    @guard
    def diffusers_prompt():
        for _ in range(6):
            out, _ = standin.run_diffusers_wan(7, 2, 8, 8, model=dmodel)
            assert rel(out, diffusers_ref) < 1e-5

    @guard
    def native_prompt():
        for _ in range(3):
            before = node_stats["engine"]
            assert rel(sample(patched), wan_ref) < 1e-4
            assert node_stats["engine"] > before

    @guard
    def switcher():
        modes = ["chunked", "off", "online", "auto", "inplace", "off"]
        i = 0
        while not stop.is_set():
            ew.set_mode(modes[i % len(modes)], 0)
            out, _ = standin.run_wrapper_model(7, 64, "sdpa", torch.float32, model=wmodel)
            assert rel(out, wrapper_ref) < 1e-5
            i += 1

    workers = [threading.Thread(target=diffusers_prompt), threading.Thread(target=native_prompt)]
    switch = threading.Thread(target=switcher)
    for t in workers + [switch]:
        t.start()
    for t in workers:
        t.join(300)
    stop.set()
    switch.join(60)
    assert not errors, errors
    ew.set_mode("off")
    assert F.scaled_dot_product_attention is TORCH_SDPA
    assert stats("torch_sdpa")["routed"] > 0  # the switches did take effect

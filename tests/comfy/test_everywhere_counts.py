"""Counts under torch.compile (issue 30, item 8), inside a real ComfyUI: the engine counts each call where it runs
(the custom op's implementation, in eager calls and in every run of a compiled graph), so Tiled Attention
Everywhere's "routed / total" and Patch Attention's settings.stats are the same compiled and eager, with
fullgraph=True and no graph break; the node output and Attention Info say how many ran inside compiled graphs and
that the calls passed on there are not seen. Compiled: WanVideoWrapper's conventions ("sdpa": torch SDPA; "comfy":
ComfyUI's global optimized_attention) as their blocks are compiled, and a native Wan 2.2 through ComfyUI's own
compile wrapper (comfy_api.torch_helpers.set_torch_compile_wrapper, what TorchCompileModel uses), with the mode and
with Patch Attention."""
import asyncio

import pytest
import torch
import torch.nn.functional as F

from comfy_harness import PACK_NAME, comfy_nodes, load_tiny, require_comfy

pytestmark = pytest.mark.comfy_inprocess
TORCH_SDPA = F.scaled_dot_product_attention


def mod(name):
    import importlib
    return importlib.import_module(f"{PACK_NAME}.{name}")


@pytest.fixture
def ew(pack, monkeypatch):
    """The pack's nodes.everywhere with the mode off, fresh counts and a fresh dynamo before and after."""
    import torch._dynamo
    everywhere, patch = mod("nodes.everywhere"), mod("attention_core.patch")
    monkeypatch.delenv("TILED_ATTENTION", raising=False)
    assert everywhere.state()["mode"] == "off" and F.scaled_dot_product_attention is TORCH_SDPA
    patch.reset_stats()
    torch._dynamo.reset()
    yield everywhere
    everywhere.set_mode("off")
    patch.reset_stats()
    torch._dynamo.reset()
    assert F.scaled_dot_product_attention is TORCH_SDPA and not patch.is_enabled()


@pytest.fixture(scope="module")
def standin(pack):
    require_comfy()
    import tools.fixtures.wrapper_pack_standin as s
    return s


def node(pack, node_id):
    nodes = asyncio.run(asyncio.run(pack.comfy_entrypoint()).get_node_list())
    return {n.GET_SCHEMA().node_id: n for n in nodes}[node_id]


def stats(path):
    return mod("attention_core.patch").stats()[path]


def graph_breaks():
    from torch._dynamo.utils import counters
    return dict(counters["graph_break"])


@pytest.mark.parametrize("convention, path", [("sdpa", "torch_sdpa"), ("comfy", "comfy_attention")])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_wrapper_conventions_compiled_count_as_eager(pack, ew, standin, convention, path, backend):
    """The wrapper-style blocks (2 blocks x self + cross attention = 4 calls a run) once eagerly, then compiled
    (fullgraph=True) twice: 12 routed of 12, 8 of them compiled, the same output, no graph break; the node's output
    and Attention Info give those counts and say that calls passed on inside graphs are not seen. Before: the
    compiled runs counted nothing (4 of 4)."""
    from torch._dynamo.utils import counters
    counters.clear()
    model = standin.tiny_wrapper_model(3)
    g = torch.Generator().manual_seed(4)
    x, context = torch.randn(1, 64, 32, generator=g), torch.randn(1, standin.TEXT_TOKENS, 32, generator=g)
    ew.set_mode("chunked", 0)
    with torch.no_grad():
        eager = model(x, context, convention, torch.float32)
        assert stats(path)["routed"] == 4
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        outs = [compiled(x, context, convention, torch.float32) for _ in range(2)]
    assert graph_breaks() == {}
    assert all(torch.allclose(o, eager, atol=1e-5) for o in outs)
    s = stats(path)
    assert (s["routed"], s["total"], s["compiled"]) == (12, 12, 8), s
    text = node(pack, "TiledAttentionEverywhere").execute("chunked", 0, None)[1]
    line = f"{path} 12 of 12 routed (8 of them inside torch.compile graphs, where calls passed on to torch or " \
           "ComfyUI are not seen)"
    assert line in text, text
    assert line in node(pack, "TiledAttentionInfo").execute()[0]


@pytest.fixture(scope="module")
def wan(tmp_path_factory, pack):
    from tools.fixtures.tiny_models import write_wan22_5b
    return load_tiny(tmp_path_factory, write_wan22_5b, "wan.safetensors", "WAN22_T2V", inference=True)


def sample(model, steps=1):
    g = torch.Generator().manual_seed(1)
    latent, cond = torch.randn(1, 48, 3, 16, 16, generator=g), torch.randn(1, 12, 4096, generator=g)
    with torch.inference_mode():
        return comfy_nodes().KSampler().sample(model, 0, steps, 3.0, "euler", "simple", [[cond, {}]],
                                               [[torch.zeros_like(cond), {}]], {"samples": latent})[0]["samples"]


def compiled(model, backend):
    """What TorchCompileModel does (comfy_extras/nodes_torch_compile.py), with fullgraph=True."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    m = model.clone()
    set_torch_compile_wrapper(model=m, backend=backend, fullgraph=True)
    return m


def _sampled(model, backend=None):
    import comfy.model_management
    try:
        return sample(compiled(model, backend) if backend else model)
    finally:
        comfy.model_management.unload_all_models()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_native_wan_compiled_by_comfyui_counts_as_eager(pack, ew, wan, backend, monkeypatch):
    """A native Wan 2.2 sampled eagerly, then through ComfyUI's compile wrapper (fullgraph=True): with Patch
    Attention its settings.stats["engine"] doubles (every compiled call counted, compiled_calls = the eager count),
    and with the process-wide mode instead (no Patch Attention: ComfyUI's global attention function) the mode's
    routed count doubles the same way, with no graph break. Before: the compiled calls counted 0."""
    from torch._dynamo.utils import counters
    from tiled_attention_pack.attention_core.device import detection
    from tiled_attention_pack.nodes.comfy_adapter import PatchSettings, install
    monkeypatch.setenv(detection.ENV_VAR, "force")
    counters.clear()
    settings = PatchSettings(mode="auto")
    model = install(wan, settings)
    ref = _sampled(model)
    eager_calls = settings.stats["engine"]
    assert eager_calls > 0 and settings.compiled_calls == 0
    out = _sampled(model, backend)
    assert settings.stats["engine"] == 2 * eager_calls and settings.compiled_calls == eager_calls
    assert torch.allclose(out, ref, atol=1e-5)
    assert mod("attention_core.patch").stats() == {}  # the mode was off: nothing counted
    ew.set_mode("chunked", 0)
    ref = _sampled(wan)
    routed = stats("comfy_attention")["routed"]
    assert routed == eager_calls  # the same attention calls, now by the mode
    out = _sampled(wan, backend)
    s = stats("comfy_attention")
    assert (s["routed"], s["total"], s["compiled"]) == (2 * routed, 2 * routed, routed), s
    assert torch.allclose(out, ref, atol=1e-5)
    assert graph_breaks() == {}

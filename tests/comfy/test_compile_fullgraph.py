"""torch.compile(fullgraph=True) of a patched tiny Wan 2.2 5B (Patch Attention + FFN Chunking) through ComfyUI's own
compile helper (comfy_api.torch_helpers.set_torch_compile_wrapper, which core TorchCompileModel uses, with
fullgraph on as KJNodes' TorchCompileModelAdvanced sets it): the pack adds no graph break and no recompile, and
the compiled model gives the eager patched model's answer. Backend "eager": graph breaks and recompiles are
decided by dynamo, before any backend runs, so the check needs no inductor build."""
import pytest
import torch

from comfy_harness import comfy_nodes, load_tiny
from tools.fixtures.tiny_models import write_wan22_5b

pytestmark = pytest.mark.comfy_inprocess


@pytest.fixture(scope="module")
def wan(tmp_path_factory, pack):
    return load_tiny(tmp_path_factory, write_wan22_5b, "wan.safetensors", "WAN22_T2V", inference=True)


def sample(model, steps=2):
    g = torch.Generator().manual_seed(1)
    latent, cond = torch.randn(1, 48, 3, 16, 16, generator=g), torch.randn(1, 12, 4096, generator=g)
    with torch.inference_mode():
        return comfy_nodes().KSampler().sample(model, 0, steps, 3.0, "euler", "simple", [[cond, {}]],
                                               [[torch.zeros_like(cond), {}]], {"samples": latent})[0]["samples"]


def compiled(model):
    """What TorchCompileModel does (comfy_extras/nodes_torch_compile.py), with fullgraph=True."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    m = model.clone()
    set_torch_compile_wrapper(model=m, backend="eager", fullgraph=True)
    return m


def dynamo_run(model):
    """Sample 2 steps of the compiled model in a fresh dynamo state: (latent, graph breaks, frames compiled)."""
    import comfy.model_management
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    try:
        out = sample(compiled(model))
        return out, dict(counters["graph_break"]), counters["stats"]["unique_graphs"]
    finally:
        comfy.model_management.unload_all_models()
        torch._dynamo.reset()


def test_patched_model_compiles_fullgraph_without_breaks_or_recompiles(pack, wan, monkeypatch):
    from tiled_attention_pack.attention_core.device import detection
    from tiled_attention_pack.nodes.comfy_adapter import PatchSettings, install
    from tiled_attention_pack.nodes.ffn import chunk_model
    # every attention call through the engine (auto: forced on this CPU, device report not yet cached, so the
    # compiled call is the first to ask): ComfyUI's own CPU attention (sub-quadratic) reads free memory through
    # psutil, itself a graph break, so the model compiles fullgraph here only with the pack
    monkeypatch.setenv(detection.ENV_VAR, "force")
    monkeypatch.setattr(detection, "_cache", {})

    def patched():
        return chunk_model(install(wan, PatchSettings(mode="auto")), 4, True)
    model = patched()  # compiled before any eager call: the first engine call and each FFN check are traced
    out, breaks, graphs = dynamo_run(model)
    assert breaks == {}, breaks
    assert graphs == 1, f"{graphs} graphs compiled for 2 identical steps: the pack made dynamo recompile"
    ref = sample(patched())
    assert torch.allclose(out, ref, atol=1e-5), float((out - ref).abs().max())
    wrappers = [p for k, p in model.object_patches.items() if k.endswith(".ffn.forward")]
    assert len(wrappers) == 2 and all(w.verified for w in wrappers)

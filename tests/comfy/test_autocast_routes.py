"""Patch Attention's routes (the MODEL override through ComfyUI's own optimized_attention wrapper, the CLIP route's
attention, the VAE route) and the process-wide mode (ComfyUI's global attention route, torch's SDPA patched) inside a
real ComfyUI (0.33.0 in-process; 0.3.75 through tests/comfy/test_inprocess_on_oldest.py) under torch.autocast: the
engine follows torch's SDPA autocast rule (attention_core/kernel/autocast.py), so each route gives the dtype
ComfyUI's pytorch attention (torch's SDPA: attention_pytorch, the VAE's pytorch_attention) gives under the same
autocast, with an error against float64 within a small multiple of its error. (ComfyUI's sub-quadratic and split
functions return the input dtype under autocast, attention_pytorch / attention_basic torch's: the routes replace
them all by the engine, which follows torch.)

Autocasts: the CPU's bf16 and fp16, its refused fp32 (off), and the float32 state CUDA's torch.autocast leaves
(WanVideoWrapper's fp32 base precision); inputs fp32, fp16, bf16. Red before (old rule: fp32 inputs cast, nothing
else): fp16 inputs under a bf16 autocast came back fp16, bf16 ones under the float32 state bf16."""
import sys

import pytest
import torch

from autocast_states import AUTOCASTS
from comfy_harness import PACK_NAME

pytestmark = pytest.mark.comfy_inprocess  # run again against 0.3.75 by test_inprocess_on_oldest.py

TORCH_SDPA = torch._C._nn.scaled_dot_product_attention
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
STATES = ["cpu-bf16", "cpu-fp16", "cpu-fp32-refused", "state-fp32"]
FACTOR, FLOOR = 4, 1e-6


def mod(name):
    return sys.modules[f"{PACK_NAME}.{name}"]


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def tokens(dtype, masked, seed=0, b=1, n=24, m=20, heads=2, dim=16):
    """ComfyUI's [B, N, H*D] q, k, v and, if masked, an additive key-padding mask (B, 1, Nk) as text encoders
    pass it."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, length, heads * dim, generator=g).to(dtype) for length in (n, m, m))
    mask = None
    if masked:
        mask = torch.zeros(b, 1, m)
        mask[..., -5:] = -torch.finfo(torch.float32).max
    return q, k, v, mask


def check(route, reference, autocast, args):
    with AUTOCASTS[autocast]():
        want = reference(*args)
        got = route(*args)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    with torch.no_grad():
        ref = reference(*(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                          for a in args))
    assert rel(got, ref) <= FACTOR * rel(want, ref) + FLOOR, (rel(got, ref), rel(want, ref))


@pytest.fixture(scope="module")
def comfy(pack):
    from comfy.ldm.modules import attention
    import comfy.ldm.modules.diffusionmodules.model as vae_model
    return attention, vae_model


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("autocast", STATES)
def test_model_override_through_comfys_wrapper(comfy, autocast, dtype, masked):
    attention, _ = comfy
    adapter = mod("nodes.comfy_adapter")
    override = adapter.make_override(adapter.PatchSettings(mode="chunked"))
    q, k, v, mask = tokens(DTYPES[dtype], masked)

    def route(q, k, v, mask):
        return attention.optimized_attention(q, k, v, 2, mask=mask,
                                             transformer_options={"optimized_attention_override": override})
    check(route, lambda q, k, v, mask: attention.attention_pytorch(q, k, v, 2, mask=mask), autocast, (q, k, v, mask))
    assert override._tiled_attention.stats["engine"] == 1


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("autocast", STATES)
def test_model_override_with_skip_reshape_as_wrapper_packs_call_it(comfy, autocast, dtype):
    """WanVideoWrapper's "comfy" mode: optimized_attention(q, k, v, heads=heads, skip_reshape=True), [B, H, N, D]."""
    attention, _ = comfy
    adapter = mod("nodes.comfy_adapter")
    override = adapter.make_override(adapter.PatchSettings(mode="online"))
    q, k, v, _ = tokens(DTYPES[dtype], False)
    q, k, v = (t.view(1, -1, 2, 16).transpose(1, 2) for t in (q, k, v))

    def route(q, k, v):
        return attention.optimized_attention(q, k, v, heads=2, skip_reshape=True,
                                             transformer_options={"optimized_attention_override": override})
    check(route, lambda q, k, v: attention.attention_pytorch(q, k, v, heads=2, skip_reshape=True), autocast,
          (q, k, v))


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("autocast", STATES)
def test_clip_route_attention(comfy, autocast, dtype, masked):
    attention, _ = comfy
    adapter, te = mod("nodes.comfy_adapter"), mod("nodes.text_encoder_route")
    settings = adapter.PatchSettings(mode="chunked", node="Patch Attention (CLIP)")
    fn = te.engine_attention(adapter.make_override(settings), attention.attention_pytorch)
    q, k, v, mask = tokens(DTYPES[dtype], masked, seed=1)
    check(lambda *a: fn(*a[:3], 2, a[3]), lambda *a: attention.attention_pytorch(*a[:3], 2, a[3]), autocast,
          (q, k, v, mask))
    assert settings.stats["engine"] == 1


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("autocast", STATES)
def test_vae_route(comfy, autocast, dtype):
    _, vae_model = comfy
    adapter, vae = mod("nodes.comfy_adapter"), mod("nodes.vae_route")
    settings = adapter.PatchSettings(mode="chunked", node="Patch Attention (VAE)")
    route = vae.VaeAttentionRoute(vae_model.pytorch_attention, settings)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 16, 4, 6, generator=g).to(DTYPES[dtype]) for _ in range(3))
    check(route, vae_model.pytorch_attention, autocast, (q, k, v))
    assert settings.stats["engine"] == 1


@pytest.fixture
def everywhere(pack):
    ew = mod("nodes.everywhere")
    assert ew.state()["mode"] == "off"
    ew.set_mode("chunked", 0)
    yield ew
    ew.set_mode("off")


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("autocast", STATES)
def test_process_wide_mode_comfys_global_route(comfy, everywhere, autocast, dtype, masked):
    """optimized_attention (ComfyUI's choice, routed by the mode) against torch's rule: torch's SDPA on the same
    [B, H, N, D] (ComfyUI's own pytorch attention is routed too while the mode is on)."""
    attention, _ = comfy
    q, k, v, mask = tokens(DTYPES[dtype], masked, seed=3)

    def torch_rule(q, k, v, mask):
        heads = [t.view(1, -1, 2, 16).transpose(1, 2) for t in (q, k, v)]
        out = TORCH_SDPA(*heads, attn_mask=None if mask is None else mask.unsqueeze(1))
        return out.transpose(1, 2).reshape(1, -1, 32)
    before = mod("attention_core.patch").stats().get("comfy_attention", {}).get("routed", 0)
    check(lambda q, k, v, mask: attention.optimized_attention(q, k, v, 2, mask=mask), torch_rule, autocast,
          (q, k, v, mask))
    assert mod("attention_core.patch").stats()["comfy_attention"]["routed"] == before + 1


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("autocast", STATES)
def test_process_wide_mode_torch_sdpa(everywhere, autocast, dtype):
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=g).to(DTYPES[dtype]) for _ in range(3))
    assert F.scaled_dot_product_attention is not TORCH_SDPA
    check(lambda *a: F.scaled_dot_product_attention(*a), TORCH_SDPA, autocast, (q, k, v))

"""attention_core.integrations.diffusers on tiny random-weight models of the real architectures diffusers ships (Wan
2.2's transformer, LTX-Video, LTX-2, Z-Image, Flux, the Wan VAE, the SD VAE): the switched model gives diffusers'
native answer within torch's own spread (both against a float64 copy), every attention call it makes runs in the
engine (counted there) and none reaches torch's SDPA, another model of the same class in the same process stays
native (0 engine calls), reset() gives back the very objects, the process-wide patch never routes a switched call a
second time, torch.compile of a switched model works, and what the switch cannot serve is refused by name."""
import copy
import contextlib

import pytest
import torch
import torch.nn.functional as F

import attention_core
from attention_core.kernel import counts

diffusers = pytest.importorskip("diffusers")  # pinned in both test environments' requirements
from attention_core.integrations import diffusers as td  # noqa: E402


def _need(name):
    cls = getattr(diffusers, name, None)
    if cls is None:
        pytest.skip(f"not applicable: diffusers {diffusers.__version__} has no {name}")
    return cls


def wan():
    """Wan 2.2's transformer (TI2V-5B layout: patch (1, 2, 2), rms_norm_across_heads q/k norm, cross-attention
    norm), tiny."""
    torch.manual_seed(0)
    model = _need("WanTransformer3DModel")(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32)
    return model, dict(hidden_states=torch.randn(1, 4, 3, 8, 8), timestep=torch.tensor([500]),
                       encoder_hidden_states=torch.randn(1, 7, 16), return_dict=False)


def ltx():
    """LTX-Video's transformer with a padded prompt (a real [batch, key tokens] cross-attention mask)."""
    torch.manual_seed(0)
    model = _need("LTXVideoTransformer3DModel")(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, num_layers=2, caption_channels=16)
    return model, dict(hidden_states=torch.randn(1, 2 * 4 * 4, 8), encoder_hidden_states=torch.randn(1, 5, 16),
                       timestep=torch.tensor([500]), encoder_attention_mask=torch.tensor([[1, 1, 1, 0, 0]]),
                       num_frames=2, height=4, width=4, return_dict=False)


def ltx2():
    """LTX-2's audio-video transformer (video and audio streams, their cross-attention both ways)."""
    torch.manual_seed(0)
    model = _need("LTX2VideoTransformer3DModel")(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=2, audio_attention_head_dim=8,
        audio_cross_attention_dim=16, num_layers=1, caption_channels=16, base_height=64, base_width=64)
    return model, dict(hidden_states=torch.randn(1, 2 * 4 * 4, 8), audio_hidden_states=torch.randn(1, 6, 8),
                       encoder_hidden_states=torch.randn(1, 5, 16), audio_encoder_hidden_states=torch.randn(1, 5, 16),
                       timestep=torch.tensor([500]), num_frames=2, height=4, width=4, audio_num_frames=6,
                       return_dict=False)


def zimage():
    """Z-Image's single-stream DiT (refiner layers, joint image-caption attention)."""
    torch.manual_seed(0)
    model = _need("ZImageTransformer2DModel")(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2,
        n_kv_heads=2, cap_feat_dim=16, axes_dims=[4, 6, 6], axes_lens=[128, 64, 64])
    return model, dict(x=[torch.randn(4, 1, 8, 8)], t=torch.tensor([0.5]), cap_feats=[torch.randn(5, 16)],
                       return_dict=False)


def flux():
    """Flux's DiT: a double-stream (joint) block and a single-stream block."""
    torch.manual_seed(0)
    model = _need("FluxTransformer2DModel")(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
    return model, dict(hidden_states=torch.randn(1, 16, 4), encoder_hidden_states=torch.randn(1, 6, 32),
                       pooled_projections=torch.randn(1, 32), timestep=torch.tensor([0.5]),
                       img_ids=torch.randn(16, 3), txt_ids=torch.zeros(6, 3), return_dict=False)


def wan_vae():
    """The Wan VAE (AutoencoderKLWan): its attention block calls torch's SDPA from its own forward."""
    torch.manual_seed(0)
    model = _need("AutoencoderKLWan")(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                      temperal_downsample=[False, True, True], latents_mean=[0.0] * 4,
                                      latents_std=[1.0] * 4)
    return model, dict(sample=torch.randn(1, 3, 5, 16, 16), return_dict=False)


def sd_vae():
    """The SD / Flux-style VAE (AutoencoderKL): diffusers' Attention with AttnProcessor2_0."""
    torch.manual_seed(0)
    model = _need("AutoencoderKL")(block_out_channels=(8, 16), norm_num_groups=4, latent_channels=4,
                                   down_block_types=("DownEncoderBlock2D",) * 2,
                                   up_block_types=("UpDecoderBlock2D",) * 2)
    return model, dict(sample=torch.randn(1, 3, 16, 16), return_dict=False)


FAMILIES = {"wan2.2": wan, "ltx": ltx, "ltx2": ltx2, "zimage": zimage, "flux": flux, "wan_vae": wan_vae,
            "sd_vae": sd_vae}


def cast(value, dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast(v, dtype) for k, v in value.items()}
    return value


def out(model, inputs):
    with torch.no_grad():
        result = model(**inputs)[0]
    return result[0] if isinstance(result, (list, tuple)) else result


@contextlib.contextmanager
def torch_sdpa_calls():
    """[calls]: torch.nn.functional.scaled_dot_product_attention calls made in the block (diffusers' native backend
    and AttnProcessor2_0 call it by that name; so does the Wan VAE)."""
    seen = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(1)
        return real(*args, **kwargs)
    F.scaled_dot_product_attention = spy
    try:
        yield seen
    finally:
        F.scaled_dot_product_attention = real


def engine_total():
    return sum(all_ for all_, _ in counts.counted("").values())


def attention_state(model):
    """What reset() must give back: each module's processor object and whether it has an instance forward."""
    return [(name, m.__dict__.get("processor", m._modules.get("processor")), "forward" in m.__dict__)
            for name, m in model.named_modules()]


@pytest.mark.parametrize("family", FAMILIES)
def test_switched_model_is_native_within_torch_spread_and_every_call_is_the_engines(family):
    model, inputs = FAMILIES[family]()
    model.eval()
    other, _ = FAMILIES[family]()  # the same class, another instance: stays native
    other.eval()
    ref = out(copy.deepcopy(model).double(), cast(inputs, torch.float64))
    before = attention_state(model)
    with torch_sdpa_calls() as native_calls:
        native = out(model, inputs)
    n_attention = len(native_calls)
    assert n_attention > 0
    other_native = out(other, inputs)

    switched = td.use_tiled(model)
    assert switched[""] > 0 and td.is_tiled(model) and not td.is_tiled(other)
    start, total = td.calls(model)[0], engine_total()
    with torch_sdpa_calls() as torch_calls:
        tiled = out(model, inputs)
    assert torch_calls == [], "a switched model's attention reached torch's SDPA"
    assert td.calls(model)[0] - start == n_attention == engine_total() - total

    total = engine_total()
    with torch_sdpa_calls() as other_calls:
        other_out = out(other, inputs)
    assert engine_total() == total and td.calls(other) == (0, 0)
    assert len(other_calls) == n_attention and torch.equal(other_out, other_native)

    scale = float(ref.abs().max())
    torch_err = float((native.double() - ref).abs().max())
    engine_err = float((tiled.double() - ref).abs().max())
    assert engine_err <= 8 * torch_err + 1e-6 * scale, (engine_err, torch_err, scale)

    td.reset(model)
    assert not td.is_tiled(model)
    after = attention_state(model)
    assert [(n, id(p), f) for n, p, f in after] == [(n, id(p), f) for n, p, f in before]
    assert torch.equal(out(model, inputs), native)


def test_a_processor_shared_with_another_model_stays_native_there():
    """set_attn_processor(one object) on two models: switching one leaves the other's (the same object) native."""
    from diffusers.models.attention_processor import AttnProcessor2_0
    a, inputs = sd_vae()
    b, _ = sd_vae()
    shared = AttnProcessor2_0()
    a.set_attn_processor(shared)
    b.set_attn_processor(shared)
    td.use_tiled(a)
    try:
        assert all(type(p) is AttnProcessor2_0 for p in b.attn_processors.values())
        assert all(p is not shared for p in a.attn_processors.values())
        total = engine_total()
        out(b, inputs)
        assert engine_total() == total
    finally:
        td.reset(a)
    assert all(p is shared for p in a.attn_processors.values())


def test_the_process_wide_patch_and_the_switch_never_route_a_call_twice():
    """enable(force=True) and a switched model together: the switched model's calls are the switch's (counted once,
    under its key; the patch never sees them), the other model's are the patch's: the engine's calls add up to the
    attention calls made, one each."""
    from attention_core import patch
    model, inputs = wan()
    other, _ = wan()
    with torch_sdpa_calls() as calls:
        out(model, inputs)
    n = len(calls)
    td.use_tiled(model)
    patch.reset_stats()
    total, mine = engine_total(), td.calls(model)[0]
    try:
        with attention_core.patched(force=True):
            out(model, inputs)
            out(other, inputs)
        stats = patch.stats().get(patch.SDPA_PATH, {})
    finally:
        td.reset(model)
    assert td.calls(model)[0] - mine == n
    assert stats.get("routed") == n and stats.get("passed", 0) == 0 and stats.get("deferred", 0) == 0, stats
    assert engine_total() - total == 2 * n


def test_diffusers_own_process_wide_backend_neither_moves_nor_reaches_a_switched_model():
    """use_tiled leaves diffusers' active backend as it is; diffusers' own attention_backend(...) block (process-wide)
    then moves the other model, never the switched one."""
    from diffusers.models import attention_dispatch
    if not hasattr(attention_dispatch, "attention_backend"):
        pytest.skip(f"not applicable: diffusers {diffusers.__version__} has no attention_backend")
    model, inputs = wan()
    other, _ = wan()
    active = attention_dispatch._AttentionBackendRegistry._active_backend
    td.use_tiled(model)
    try:
        assert attention_dispatch._AttentionBackendRegistry._active_backend == active
        with attention_dispatch.attention_backend("_native_math"):
            start = td.calls(model)[0]
            with torch_sdpa_calls() as seen:
                out(model, inputs)
            assert seen == [] and td.calls(model)[0] - start == 4
            with torch_sdpa_calls() as seen:
                out(other, inputs)
            assert len(seen) == 4 and td.calls(other) == (0, 0)
    finally:
        td.reset(model)


def test_tiled_block_restores_the_state_before_it():
    model, inputs = flux()
    native = out(model, inputs)
    with td.tiled(model, tier="online") as done:
        assert done == {"": 2} and td.is_tiled(model)
        with td.tiled(model, tier="chunked"):
            assert model.__dict__[td._ROUTE_ATTR].options == {"tier": "chunked"}
        assert model.__dict__[td._ROUTE_ATTR].options == {"tier": "online"}
        start = td.calls(model)[0]
        out(model, inputs)
        assert td.calls(model)[0] - start == 2
    assert not td.is_tiled(model)
    assert torch.equal(out(model, inputs), native)


def test_a_pipeline_switches_each_model_component():
    """A real WanPipeline (Wan 2.2's transformer and VAE, no text encoder: prompt embeddings given), two steps: the
    tiled video matches the native one within torch's spread (against the same pipeline in float64), and the
    transformer's and the VAE's attention calls are all the engine's."""
    pipe_cls = _need("WanPipeline")
    from diffusers import FlowMatchEulerDiscreteScheduler

    def pipeline(dtype):
        transformer, _ = wan()
        vae, _ = wan_vae()
        pipe = pipe_cls(tokenizer=None, text_encoder=None, transformer=transformer.to(dtype), vae=vae.to(dtype),
                        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def run(pipe, dtype):
        emb = torch.randn(1, 7, 16, generator=torch.Generator().manual_seed(3)).to(dtype)
        latents = torch.randn(1, 4, 2, 4, 4, generator=torch.Generator().manual_seed(4)).to(dtype)
        return pipe(prompt_embeds=emb, negative_prompt_embeds=emb, latents=latents, height=32, width=32,
                    num_frames=5, num_inference_steps=2, guidance_scale=1.0, output_type="pt").frames.double()
    ref = run(pipeline(torch.float64), torch.float64)
    pipe = pipeline(torch.float32)
    native = run(pipe, torch.float32)
    with td.tiled(pipe) as done:
        assert set(done) == {"transformer", "vae"} and all(done.values()), done
        with torch_sdpa_calls() as torch_calls:
            tiled = run(pipe, torch.float32)
        assert torch_calls == []
        assert td.calls(pipe.transformer)[0] > 0 and td.calls(pipe.vae)[0] > 0
    assert not td.is_tiled(pipe.transformer) and not td.is_tiled(pipe.vae)
    torch_err = float((native - ref).abs().max())
    engine_err = float((tiled - ref).abs().max())
    assert engine_err <= 8 * torch_err + 1e-6, (engine_err, torch_err)


def test_torch_compile_of_a_switched_model_runs_the_engine_in_the_graph():
    model, inputs = wan()
    td.use_tiled(model)
    try:
        eager = out(model, inputs)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        start = td.calls(model)
        got = out(compiled, inputs)
        all_, in_graph = td.calls(model)
        assert in_graph - start[1] == all_ - start[0] == 4  # 2 blocks x (self + cross)
        assert float((got - eager).abs().max()) <= 1e-5 * float(eager.abs().max())
    finally:
        td.reset(model)
        torch.compiler.reset()


class _FullPathProcessor:
    """An attention processor that calls torch's SDPA by its full path: beyond what the switch rebinds."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None):
        q = k = v = hidden_states[:, None]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)[:, 0]


def test_what_the_switch_cannot_reach_is_refused_by_name_before_anything_changes():
    from diffusers.models.attention_processor import AttnProcessor
    model, _ = sd_vae()
    model.set_attn_processor(AttnProcessor())  # explicit matmuls, no SDPA
    state = attention_state(model)
    with pytest.raises(ValueError, match=r"AttnProcessor computes attention without torch's SDPA.*AttnProcessor2_0"):
        td.use_tiled(model)
    assert attention_state(model) == state and not td.is_tiled(model)
    model.set_attn_processor(_FullPathProcessor())
    with pytest.raises(ValueError, match=r"_FullPathProcessor calls functional\.scaled_dot_product_attention.*"
                                         r"attention_core\.patched\(\)"):
        td.use_tiled(model)
    with pytest.raises(ValueError, match="found no attention"):
        td.use_tiled(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="engine options"):
        td.use_tiled(flux()[0], count_as="x")
    with pytest.raises(ValueError, match="tier must be one of"):
        td.use_tiled(flux()[0], tier="fast")


def test_context_parallel_calls_are_refused_at_the_call():
    route = td.Route("diffusers:test", {})
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(NotImplementedError, match="context parallelism.*'native'"):
        route.dispatch(q, q, q, parallel_config=object())
    with pytest.raises(NotImplementedError, match=r"attention_kwargs \['return_lse'\]"):
        route.dispatch(q, q, q, attention_kwargs={"return_lse": True})


class _ModuleProcessor(torch.nn.Module):
    """A processor that is a torch module with its attention in forward (called through Module.__call__)."""

    def forward(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None):
        b, c, h, w = hidden_states.shape
        x = hidden_states.flatten(2).transpose(1, 2)[:, None]
        q, k, v = attn.to_q(x), attn.to_k(x), attn.to_v(x)
        y = F.scaled_dot_product_attention(q, k, v)[:, 0]
        return attn.to_out[0](y).transpose(1, 2).reshape(b, c, h, w) + hidden_states


def test_a_processor_module_with_attention_in_its_forward_is_switched_through_its_forward():
    model, inputs = sd_vae()
    model.set_attn_processor(_ModuleProcessor())
    with torch_sdpa_calls() as native_calls:
        native = out(model, inputs)
    with td.tiled(model) as done:
        assert done[""] == 1  # set_attn_processor put one object in both attention modules: one forward rebound
        start = td.calls(model)[0]
        with torch_sdpa_calls() as seen:
            tiled = out(model, inputs)
        assert seen == [] and td.calls(model)[0] - start == len(native_calls) == 2
    assert float((tiled - native).abs().max()) <= 1e-5 * float(native.abs().max())


@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
def test_a_batch_by_key_tokens_mask_is_read_as_diffusers_native_backend_reads_it(mask_kind):
    """dispatch_attention_fn given a 2-D [batch, key tokens] mask (a padded prompt): diffusers' native backend takes
    it as [batch, 1, 1, key tokens] (since its 2-D reading; diffusers 0.35 handed it to torch as it was, an error
    whenever batch != query tokens); the switch's dispatch gives that answer (float64, against torch's SDPA and
    diffusers' native backend where it reads 2-D masks), and a 2-D mask of another shape ([query tokens, key
    tokens]) is torch's plain 2-D mask on every side."""
    ad = pytest.importorskip("diffusers.models.attention_dispatch")
    torch.manual_seed(0)
    b, lq, lk, h, d = 2, 3, 5, 2, 8  # batch != key tokens and != query tokens: each reading gives another shape
    q, k, v = (torch.randn(b, n, h, d, dtype=torch.float64) for n in (lq, lk, lk))
    keep = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    pad = keep if mask_kind == "bool" else torch.zeros(b, lk, dtype=torch.float64).masked_fill(~keep, -1e4)
    square = torch.rand(lq, lk) > 0.3 if mask_kind == "bool" else torch.randn(lq, lk, dtype=torch.float64)
    square[:, 0] = True if mask_kind == "bool" else square[:, 0]
    route = td.Route("diffusers:test", {})

    def torch_answer(mask):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              mask).transpose(1, 2)
    for mask, as_torch_reads_it in ((pad, pad[:, None, None, :]), (square, square)):
        tiled = route.dispatch(q, k, v, attn_mask=mask)
        assert tiled.shape == (b, lq, h, d)
        assert torch.allclose(tiled, torch_answer(as_torch_reads_it), rtol=1e-10, atol=1e-12)
        try:
            native = ad.dispatch_attention_fn(q, k, v, attn_mask=mask, backend=ad.AttentionBackendName.NATIVE)
        except RuntimeError:
            assert mask is pad and diffusers.__version__.startswith("0.35.")  # no 2-D reading there yet
            continue
        assert torch.allclose(tiled, native, rtol=1e-10, atol=1e-12)
    # the padded keys get no weight: changing their values leaves the output as it was
    v2 = v.clone()
    v2[0, 3:] += 100.0
    assert torch.allclose(route.dispatch(q, k, v2, attn_mask=pad)[0], route.dispatch(q, k, v, attn_mask=pad)[0],
                          rtol=1e-10, atol=1e-12)

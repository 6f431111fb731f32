"""Real model code through the global patch: transformers and diffusers tiny random models give torch's answer
with attention_core.enable(force=True), within a bound relative to torch's own fp32 error (both against a float64
copy of the same model)."""
import copy

import pytest
import torch

import attention_core
import attention_core.sdpa as sdpa_mod

transformers = pytest.importorskip("transformers")  # pinned in tests/requirements-test.txt


@pytest.fixture
def engine_calls(monkeypatch):
    calls = []
    real = sdpa_mod.scaled_dot_product_attention
    monkeypatch.setattr(sdpa_mod, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    yield calls
    attention_core.disable()


def _out(result):
    for name in ("logits", "last_hidden_state", "sample"):
        if hasattr(result, name):
            return getattr(result, name)
    return result[0] if isinstance(result, (tuple, list)) else result


def _cast(inputs, dtype):
    return {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in inputs.items()}


def check_model(model, inputs, engine_calls, grad=False):
    """fp32 model with and without the patch vs a float64 copy: the patched error within 8x torch's (+ a floor)."""
    model = model.float().eval()
    ref_model = copy.deepcopy(model).double()
    with torch.no_grad():
        ref = _out(ref_model(**_cast(inputs, torch.float64)))
        plain = _out(model(**inputs))
        with attention_core.patched(force=True):
            patched = _out(model(**inputs))
    assert engine_calls, "the model never reached the engine through the patch"
    scale = float(ref.abs().max())
    torch_err = float((plain.double() - ref).abs().max())
    engine_err = float((patched.double() - ref).abs().max())
    assert engine_err <= 8 * torch_err + 1e-6 * scale, (engine_err, torch_err, scale)
    if grad:
        model.zero_grad()
        _out(model(**inputs)).square().mean().backward()
        want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        with attention_core.patched(force=True):
            _out(model(**inputs)).square().mean().backward()
        for n, p in model.named_parameters():
            if n in want:
                tol = 1e-4 * float(want[n].abs().max()) + 1e-7
                assert float((p.grad - want[n]).abs().max()) <= tol, n


def _ids(batch=2, length=12, vocab=64, pad_first=3):
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (batch, length))
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, :pad_first] = 0  # left padding in the second sequence: a real boolean / additive mask
    return {"input_ids": ids, "attention_mask": mask}


def test_tiny_llama_gqa_causal_padded(engine_calls):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
    check_model(model, _ids(), engine_calls, grad=True)


def test_tiny_llama_unpadded_is_causal(engine_calls):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=1, max_position_embeddings=64)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
    check_model(model, {"input_ids": _ids()["input_ids"]}, engine_calls)


def test_tiny_bert_padded(engine_calls):
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     max_position_embeddings=64)
    check_model(BertModel._from_config(cfg, attn_implementation="sdpa"), _ids(), engine_calls, grad=True)


def test_tiny_vit(engine_calls):
    from transformers import ViTConfig, ViTModel
    torch.manual_seed(0)
    cfg = ViTConfig(image_size=16, patch_size=4, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4)
    model = ViTModel._from_config(cfg, attn_implementation="sdpa")
    check_model(model, {"pixel_values": torch.randn(2, 3, 16, 16)}, engine_calls)


def test_tiny_diffusers_unet_cross_attention(engine_calls):
    diffusers = pytest.importorskip("diffusers")  # pinned in tests/requirements-test.txt
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=24, attention_head_dim=8, norm_num_groups=8)
    inputs = {"sample": torch.randn(2, 4, 8, 8), "timestep": torch.tensor([10, 500]),
              "encoder_hidden_states": torch.randn(2, 7, 24)}
    check_model(unet, inputs, engine_calls)


def test_tiny_diffusers_dit_transformer(engine_calls):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    dit = diffusers.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=2,
                                          sample_size=8, patch_size=2, num_embeds_ada_norm=10, norm_num_groups=8)
    inputs = {"hidden_states": torch.randn(2, 4, 8, 8), "timestep": torch.tensor([1, 7]),
              "class_labels": torch.tensor([0, 3])}
    check_model(dit, inputs, engine_calls, grad=True)

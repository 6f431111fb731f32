"""Decoding with a KV cache is exact through the global patch (issue 35 item 4).

Greedy generation with transformers' own Qwen2 and Llama (tiny configurations of the real architectures: grouped-query
attention, RoPE, the real MLP; random weights, attn_implementation="sdpa"): a prompt's prefill, then one query token
per step against the cache, then a second prompt chunk (several query rows against a longer cache: a causal mask with
an offset), then more single-token steps. Run once with torch's math SDPA (sdpa_kernel(MATH)) and once through
attention_core.patched(force=True): the same tokens, logits within a bound relative to torch's own error (both
against a float64 copy of the model), and attention_core.patch.stats() saying every SDPA call of the patched run went
to the engine (one per layer per forward, none passed on). fp32 and fp16 (the CPU runs fp16 too).
"""
import copy

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import attention_core
from attention_core import patch

transformers = pytest.importorskip("transformers")  # pinned in tests/requirements-test.txt

LAYERS = 2
PROMPT, STEPS, CHUNK, STEPS_AFTER = 11, 6, 5, 4
FORWARDS = 1 + STEPS + 1 + STEPS_AFTER  # model calls of one generation (prefill, steps, chunk, steps)


def _qwen2(seed):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    # Qwen 2.5 0.5B's shape family at toy width: 7 query heads over 1 key-value head (the real one has 14 over 2),
    # head dim 8, qkv bias, tied embeddings; a wider initialiser so that the greedy choice is never a near-tie
    cfg = Qwen2Config(vocab_size=97, hidden_size=56, intermediate_size=112, num_hidden_layers=LAYERS,
                      num_attention_heads=7, num_key_value_heads=1, max_position_embeddings=128,
                      tie_word_embeddings=True, initializer_range=0.3)
    return Qwen2ForCausalLM._from_config(cfg, attn_implementation="sdpa")


def _llama(seed):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.3)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")


def _new_cache(model):
    from transformers import DynamicCache
    try:
        return DynamicCache(config=model.config)  # transformers 5
    except TypeError:
        return DynamicCache()  # transformers 4.57


def _cache_kw(model, cache):
    """The model's keyword for the KV cache: `cache` (transformers 5.x) or `past_key_values` (4.x)."""
    import inspect
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


def generate(model, prompt, chunk):
    """Greedy tokens and the logits of each choice: prefill `prompt`, STEPS single tokens, the `chunk` (appended
    after them) against the cache, STEPS_AFTER single tokens; every call through the model's cache."""
    cache = _new_cache(model)
    tokens, logits = [], []

    def step(ids):
        out = model(input_ids=ids, **_cache_kw(model, cache))
        last = out.logits[0, -1].double()
        logits.append(last)
        tokens.append(int(last.argmax()))
        return torch.tensor([[tokens[-1]]])

    with torch.no_grad():
        nxt = step(prompt)
        for _ in range(STEPS):
            nxt = step(nxt)
        nxt = step(torch.cat([nxt, chunk], dim=1)[:, :CHUNK])  # the last choice, then a prompt chunk
        for _ in range(STEPS_AFTER):
            nxt = step(nxt)
    return tokens, torch.stack(logits)


def _teacher_forced(model, prompt, chunk, tokens):
    """The logits of the same call sequence fed `tokens` (so a float64 copy follows the same path)."""
    cache = _new_cache(model)
    feed = [prompt] + [torch.tensor([[t]]) for t in tokens[:STEPS]]
    feed.append(torch.cat([torch.tensor([[tokens[STEPS]]]), chunk], dim=1)[:, :CHUNK])
    feed += [torch.tensor([[t]]) for t in tokens[STEPS + 1:-1]]
    out = []
    with torch.no_grad():
        for ids in feed:
            out.append(model(input_ids=ids, **_cache_kw(model, cache)).logits[0, -1].double())
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("build", [_qwen2, _llama], ids=["qwen2", "llama"])
def test_greedy_decoding_with_cache_gives_math_sdpas_tokens(build, dtype):
    model = build(0).eval()
    ref_model = copy.deepcopy(model).double()
    model = model.to(dtype)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT), generator=g)
    chunk = torch.randint(0, model.config.vocab_size, (1, CHUNK), generator=g)

    with sdpa_kernel([SDPBackend.MATH]):
        want, math_logits = generate(model, prompt, chunk)
    patch.reset_stats()
    try:
        with attention_core.patched(force=True):
            got, engine_logits = generate(model, prompt, chunk)
        seen = patch.stats().get(patch.SDPA_PATH, {})
    finally:
        patch.reset_stats()
    assert got == want, f"{dtype}: greedy tokens differ from math SDPA's: {got} vs {want}"
    assert len(want) == FORWARDS

    # every call of the patched generation ran in the engine: one per layer per forward, none passed on
    assert seen.get("routed") == LAYERS * FORWARDS, seen
    assert seen.get("passed", 0) == 0, seen

    # the logits are as close to a float64 copy's as math SDPA's own (same call sequence, same tokens fed)
    ref = _teacher_forced(ref_model, prompt, chunk, want)
    torch_err = float((math_logits - ref).abs().max())
    engine_err = float((engine_logits - ref).abs().max())
    scale = float(ref.abs().max())
    assert engine_err <= 4 * torch_err + 1e-6 * scale, (engine_err, torch_err, scale)
    # and no greedy choice was a tie within the two runs' disagreement (where equal tokens would be luck, not proof)
    top2 = math_logits.topk(2, dim=-1).values
    apart = float((engine_logits - math_logits).abs().max())
    assert float((top2[:, 0] - top2[:, 1]).min()) > 2 * apart, "a near-tie between two tokens: pick another seed"

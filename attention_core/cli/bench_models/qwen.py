"""Qwen 2.5 0.5B prefill and decode-step benchmarks: transformers' own Qwen2 model at the real configuration
(hidden 896, 14 query and 2 key-value heads, head dim 64, the real MLP of 4864, vocabulary 151,936, RoPE base 10^6),
random weights, attn_implementation="sdpa", with fewer layers than the real 24 (--depth; each layer is the same
work, so a layer's share of the time and memory is the same at any depth).

Methods, the same model and inputs in a fresh process each:
    math     torch's math SDPA (torch.nn.attention.sdpa_kernel(SDPBackend.MATH)): what GPUs without fused
             attention run
    engine   this pack's engine through the global patch (attention_core.patched(force=True)); its calls counted
    torch    torch's default SDPA (fused where this device has a kernel)
Prefill: one forward over N prompt tokens (logits of the last one only, as generation needs). Decode step: one
query token against a cache of N tokens (the cache filled with random keys and values, as after a prefill of N).
Where math's scores would not fit the memory budget (--memory-budget-gb) the case is not run and the table says
so.
"""
from __future__ import annotations

import contextlib

from . import measure

NAMES = {"prefill": "qwen2.5-0.5b-prefill", "decode": "qwen2.5-0.5b-decode"}
METHODS = ["math", "engine", "torch"]
LABELS = {"math": "math SDPA", "engine": "engine (global patch)", "torch": "torch default SDPA"}
SIZES = {"prefill": [1024, 2048, 4096, 8192, 16384], "decode": [4096, 16384]}
QUICK_SIZES = {"prefill": [64, 128], "decode": [64, 256]}
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, MLP, VOCAB, LAYERS = 14, 2, 64, 896, 4864, 151936, 24
COUNT_PATH = "torch_sdpa"  # attention_core.patch.stats() key of the global patch's calls


def config(depth: int, vocab: int = VOCAB):
    """transformers' Qwen2Config of Qwen 2.5 0.5B (Qwen/Qwen2.5-0.5B's config.json) with `depth` layers."""
    from transformers import Qwen2Config
    return Qwen2Config(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=depth,
                       num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=32768,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
                       hidden_act="silu")


def math_bytes(kind: str, n: int, elem: int) -> int:
    """What math SDPA holds at once in one layer: the scores and their softmax (B=1, 14 heads), plus the causal
    mask's N x N booleans for a prefill."""
    if kind == "decode":
        return 2 * HEADS * n * elem
    return 2 * HEADS * n * n * elem + n * n


def _method(name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from ...patch import patched
    if name == "math":
        return sdpa_kernel([SDPBackend.MATH])
    if name == "engine":
        return patched(force=True)
    if name == "torch":
        return contextlib.nullcontext()
    raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")


def _cache_kw(model, cache) -> dict:
    """The model's keyword for the KV cache: `cache` (transformers 5.x) or `past_key_values` (4.x)."""
    import inspect
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


def _filled_cache(model, n: int, dtype, device, gen):
    """A DynamicCache holding n random keys and values per layer, as a prefill of n tokens leaves it."""
    import torch
    from transformers import DynamicCache
    try:
        cache = DynamicCache(config=model.config)  # transformers 5
    except TypeError:
        cache = DynamicCache()  # transformers 4.x
    for layer in range(model.config.num_hidden_layers):
        k, v = (torch.randn(1, KV_HEADS, n, HEAD_DIM, generator=gen).to(device, dtype) for _ in range(2))
        cache.update(k, v, layer)
    return cache


def run_case(case: dict) -> dict:
    """One (kind, method, N) in this process: {"ms", "peak_mb", "routed", "passed"} (routed / passed: the global
    patch's calls during the measured runs, None for the other methods)."""
    import torch
    from transformers import Qwen2ForCausalLM
    from ... import patch
    if case.get("threads"):
        torch.set_num_threads(case["threads"])
    dtype, device, n = getattr(torch, case["dtype"]), case["device"], case["n"]
    torch.manual_seed(case.get("seed", 0))
    model = Qwen2ForCausalLM._from_config(config(case["depth"], case.get("vocab", VOCAB)), attn_implementation="sdpa")
    model = model.to(device, dtype).eval()
    gen = torch.Generator().manual_seed(n)
    vocab = model.config.vocab_size
    if case["kind"] == "prefill":
        ids = torch.randint(0, vocab, (1, n), generator=gen).to(device)

        def run(tokens=ids):
            return model(input_ids=tokens, use_cache=False, logits_to_keep=1).logits
        warm = lambda: run(ids[:, :min(n, 32)])  # noqa: E731
    else:
        cache = _filled_cache(model, n, dtype, device, gen)
        tok = torch.randint(0, vocab, (1, 1), generator=gen).to(device)

        def run():
            out = model(input_ids=tok, logits_to_keep=1, **_cache_kw(model, cache)).logits
            cache.crop(-1)  # drop the step's token: every measured step sees the same N cached tokens
            return out

        def warm():
            small = _filled_cache(model, min(n, 32), dtype, device, gen)
            return model(input_ids=tok, logits_to_keep=1, **_cache_kw(model, small)).logits
    with torch.no_grad(), _method(case["method"]):
        warm()  # thread pools and lazy init are not the method's time or memory
        patch.reset_stats()
        res = measure.measured(run, device, case["repeats"])
        seen = patch.stats().get(COUNT_PATH, {})
    patch.reset_stats()
    if case["method"] == "engine":
        res.update(routed=seen.get("routed", 0), passed=seen.get("passed", 0),
                   expected=case["depth"] * case["repeats"])
    return res


def cases(kind: str, a, elem: int, budget: float) -> list:
    """[(size label, {method: case, or why it is not run})] for the driver."""
    out = []
    for n in a.sizes:
        per = {}
        for m in a.methods:
            need = math_bytes(kind, n, elem) if m == "math" else 0
            if need > budget:
                per[m] = (f"math SDPA needs ~{need / measure.GIB:,.1f} GB for one layer's scores, over the "
                          f"{budget / measure.GIB:,.1f} GB budget (--memory-budget-gb): out of memory here")
            else:
                per[m] = dict(kind=kind, method=m, n=n, depth=a.depth, dtype=a.dtype, device=a.device,
                              repeats=a.repeats, threads=a.threads, vocab=a.vocab, seed=0)
        label = f"{n // 1024}K" if n % 1024 == 0 else str(n)
        out.append((label, per))
    return out


def describe(kind: str, a) -> str:
    what = ("prefill: one forward over N prompt tokens" if kind == "prefill"
            else "decode step: one query token against N cached tokens")
    vocab = f", vocabulary {a.vocab:,}" if a.vocab != VOCAB else ""
    return (f"Qwen 2.5 0.5B {what}; transformers' Qwen2 at the real widths (896 hidden, {HEADS}/{KV_HEADS} heads x "
            f"{HEAD_DIM}, MLP {MLP}{vocab}), {a.depth} of {LAYERS} layers, random weights, {a.dtype} on {a.device}")


if __name__ == "__main__":
    import sys
    sys.exit(measure.child_main(run_case))

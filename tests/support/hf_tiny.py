"""Tiny random-weight models of real transformers architectures (the library's own classes) for the
attn_implementation="tiled" tests, and the math-SDPA reference they are compared with."""
import contextlib

import torch

ARCHS = ("qwen2", "llama", "mistral", "gemma3")
LAYERS = 2  # every tiny model: one attention call per layer and forward


def config(arch, **over):
    """A tiny config of `arch` (4 query / 2 key-value heads, head dim 16, 2 layers; sliding window 8 where the
    architecture has sliding layers: Qwen2's second layer, every Mistral layer, Gemma 3's first of two)."""
    import transformers as tf
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    common.update(over)
    if arch == "qwen2":
        return tf.Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=1, **common)
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "mistral":
        return tf.MistralConfig(sliding_window=8, **common)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                   layer_types=["sliding_attention", "full_attention"], **common)
    raise ValueError(arch)


def model(arch, impl="tiled", dtype=torch.float32, seed=0, **over):
    import transformers as tf
    torch.manual_seed(seed)
    cfg = config(arch, **over)
    kw = {"torch_dtype" if _old() else "dtype": dtype}
    return tf.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, **kw).eval()


def _old():
    import transformers as tf
    return int(tf.__version__.split(".")[0]) < 5


@contextlib.contextmanager
def math_sdpa():
    """torch's math SDPA backend only (the reference)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH):
        yield


@contextlib.contextmanager
def torch_sdpa_spy(monkeypatch):
    """Counts the calls of torch.nn.functional.scaled_dot_product_attention (list of one int)."""
    import torch.nn.functional as F
    seen = [0]
    real = F.scaled_dot_product_attention

    def spy(*a, **k):
        seen[0] += 1
        return real(*a, **k)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    yield seen
    monkeypatch.setattr(F, "scaled_dot_product_attention", real)

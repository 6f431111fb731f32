"""Kills for the engine survivors of the fresh draw of seed 947447 (docs/mutation-draws.jsonl): the Qwen 2.5 0.5B
preset's widths and its math-SDPA memory, the Wan 2.2 14B 480p plan preset, an explicit FFN chunk count of 1, and
the FFN exactness probe's per-feature statistics, and the ranks-disagree message's shapes (group._fmt)."""
import torch

from attention_core.cli import plan
from attention_core.cli.bench_models import qwen
from attention_core.ffn import chunking, exactness


def test_the_qwen_preset_has_qwen_2_5_0_5b_s_published_widths():
    """Qwen/Qwen2.5-0.5B's config.json: 14 heads, 2 kv heads, 896 wide (head dim 64), MLP 4864, vocabulary 151,936,
    24 layers; the benchmark claims the real widths."""
    assert (qwen.HEADS, qwen.KV_HEADS, qwen.HEAD_DIM, qwen.HIDDEN, qwen.MLP, qwen.VOCAB, qwen.LAYERS) == \
        (14, 2, 64, 896, 4864, 151936, 24)
    assert qwen.HEADS * qwen.HEAD_DIM == qwen.HIDDEN


def test_math_sdpa_memory_of_a_decode_step_and_a_prefill():
    """Decoding one token against n cached ones: scores and softmax of 14 heads x n (2 x 14 x n x elem bytes);
    a prefill of n tokens: 2 x 14 x n^2 x elem plus the n x n causal mask."""
    assert qwen.math_bytes("decode", 4096, 2) == 2 * 14 * 4096 * 2
    assert qwen.math_bytes("decode", 1000, 4) == 2 * 14 * 1000 * 4
    assert qwen.math_bytes("prefill", 1024, 2) == 2 * 14 * 1024 * 1024 * 2 + 1024 * 1024


def test_the_wan_14b_480p_preset_is_832_by_480_at_81_frames():
    """32,760 tokens: 21 latent frames x 30 x 52 patches (8x8 VAE, 2x2 patches) at 832 x 480."""
    model, width, height, frames = plan.PRESETS["wan-14b-480p"][:4]
    assert (model, width, height, frames) == ("wan-14b", 832, 480, 81)
    assert plan.estimate(model, width, height, frames, free=32 << 30)["tokens"] == 32760


def test_an_explicit_chunk_count_is_taken_as_given_even_one():
    """chunks = 1 is one chunk whatever free memory would suggest (0 is the automatic count); never more chunks
    than tokens."""
    x = torch.zeros(1, 64, 8)
    for chunks in (1, 2, 64, 100):
        assert chunking.chunk_count(x, 1, chunks, 32) == min(chunks, 64)
    import attention_core.ffn.chunking as mod
    original = mod.free_memory
    try:
        mod.free_memory = lambda device: 1  # one byte free: the automatic count would split every token
        assert chunking.chunk_count(x, 1, 1, 32) == 1
        assert chunking.chunk_count(x, 1, 0, 32) > 1
    finally:
        mod.free_memory = original


def test_the_exactness_probe_draws_tokens_with_each_feature_s_own_mean_and_spread():
    """_random_like keeps per-feature statistics (over every dim but the last): a feature centred at 100 stays near
    100 and one at -100 near -100, not both at the overall mean 0."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 512, 2, generator=g)
    x[..., 0] += 100.0
    x[..., 1] -= 100.0
    y = exactness._random_like(x)
    means = y.mean(dim=(0, 1))
    assert abs(float(means[0]) - 100.0) < 1.0 and abs(float(means[1]) + 100.0) < 1.0, means


def test_the_ranks_disagree_message_shows_at_most_four_dims_of_each_shape():
    """group._fmt reads a 6-slot record (ndim, 4 dims right-aligned, dtype index); a record of more than 4 dims shows
    the 4 it holds, fewer shows only its own, -1 / -2 name a missing input and a non-tensor."""
    from attention_core.parallel import group
    assert group._fmt([4, 2, 3, 5, 7, 1]) == "(2, 3, 5, 7) float32"
    assert group._fmt([5, 2, 3, 5, 7, 2]) == "(2, 3, 5, 7) float16"
    assert group._fmt([2, 0, 0, 5, 7, 4]) == "(5, 7) bool"
    assert group._fmt([3, 0, 9, 5, 7, 99]) == "(9, 5, 7) other"
    assert group._fmt([-1, 0, 0, 0, 0, 0]) == "None" and group._fmt([-2, 0, 0, 0, 0, 0]) == "not a tensor"

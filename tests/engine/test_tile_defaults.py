"""The engine's default tiles without a tuned profile (issues 18.5 and 24): sized for the speed measured on a quiet
CPU (docs/bench-tiles-cpu.md), within the memory bounds of issue 24, measured with LiveBytes (every tensor's
storage): the Wan 2.2 5B 480p forward (24 heads x 128, 4,290 keys) holds at most 3 % of ComfyUI sub-quadratic
attention's 3,220 MB (its output plus one tile), and forward + backward at N = 2048, 8 heads hold <= 15 % of torch's
math SDPA."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention_core.kernel import memory, ops
from live_bytes import peak_bytes

MB = 1 << 20


@pytest.fixture(autouse=True)
def large_budget(monkeypatch):
    """A fixed share of memory, so the tile comes from the default target, not from what is free right now."""
    monkeypatch.setattr(memory, "free_memory", lambda device: 8 << 30)


def test_wan_480p_forward_tile_is_the_fast_one_within_3_percent_of_sub_quadratic():
    """The tile beyond the output: 2^23 scores (24 heads x 80 rows x 4,290 keys) x 4 bytes (the softmax overwrites
    the scores on the CPU) = 31 MB; with the full call's 52.7 MB output that is <= 3 % of sub-quadratic's 3,220 MB
    (bench: 84 MB, docs/bench-wan22-480p-quiet-cpu.json). Not the 2-4 MB tiles of 2^19, 1.2-1.4x slower quiet. The
    first 256 query rows take the same tiles as the whole call (80 rows of every head)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 24, 256, 128, generator=g)
    k, v = (torch.randn(1, 24, 4290, 128, generator=g) for _ in range(2))
    with torch.no_grad():
        peak = peak_bytes(ops.attention_forward, q, k, v, tier="chunked")  # the engine's ops, seen op by op
    out_bytes = q.numel() * 4 + 2 * 24 * 256 * 4  # O, L and the row max
    full_output = 24 * 4290 * 128 * 4
    tile = peak - out_bytes
    assert tile + full_output <= 0.03 * 3220 * MB, f"{tile / MB:.1f} MB beyond the output"
    assert tile >= 16 * MB, f"{tile / MB:.1f} MB: not the 2^23-score tile"


def test_forward_backward_holds_at_most_a_fifth_of_math():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 8, 2048, 64, generator=g).requires_grad_() for _ in range(3))
    dout = torch.randn(1, 8, 2048, 64, generator=g)

    def engine():  # what the autograd function runs: the forward keeps O and L, the backward recomputes tiles
        out, lse = ops.attention_forward(q.detach(), k.detach(), v.detach())
        ops.attention_backward(dout, q.detach(), k.detach(), v.detach(), out, lse)

    def math():
        with sdpa_kernel([SDPBackend.MATH]):
            F.scaled_dot_product_attention(q, k, v).backward(dout)
    ours, theirs = peak_bytes(engine), peak_bytes(math)
    assert ours <= 0.15 * theirs, f"{ours / MB:.0f} MB vs math {theirs / MB:.0f} MB"


def test_backward_peak_is_its_tile_loop_not_the_transposed_copies():
    """The backward accumulates dK^T and dV^T (the faster GEMM layout) and copies them back to (B, H, N, E) at the
    end, after its two score-sized tile buffers (S / P and dP, 2^21 fp32 scores each at N = 2048, 8 heads) are
    let go: its peak is the loop's, 2 tiles + dQ + dK^T + dV^T (+ per-row statistics and one query tile's dQ),
    not the loop's buffers plus the copies (32.6 MB when the buffers were kept)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 8, 2048, 64, generator=g) for _ in range(3))
    dout = torch.randn(1, 8, 2048, 64, generator=g)
    out, lse = ops.attention_forward(q, k, v)
    peak = peak_bytes(ops.attention_backward, dout, q, k, v, out, lse)
    tiles, grad = 2 * memory.BACKWARD_TILE_ELEMS["cpu"] * 4, q.numel() * 4
    loop = tiles + 3 * grad
    assert peak <= loop + 2 * MB, f"{peak / MB:.1f} MB: more than the tile loop's {loop / MB:.0f} MB"


def test_gpu_and_cpu_targets_at_the_wan_720p_shape():
    """Without a profile a GPU forward tile aims at 2^27 scores (the fp32 S and P of 24 heads x 192 rows x 28,520
    keys: 1 GiB, a fraction of a 32 GB MI50), online tiles take 4,096 keys, and the backward aims at the same 2^27
    on GPUs but 2^21 on the CPU; the CPU forward takes one head (2^23 / 28,520 = 294 pairs, fewer than
    FORWARD_PREF_ROWS = 256 rows of two heads), its rows filling the target: 288. Shapes only: memory.tile_for with an ample budget, Wan 2.2 5B 720p (24 heads, 28,520
    keys)."""
    n, heads = 28520, 24
    assert memory.tile_for(n, heads, 1, 8, 1 << 40, n, "other") == (192, n, heads)
    assert memory.tile_for(n, heads, 1, 4, 1 << 40, n, "cpu", threads=2) == (288, n, 1)
    assert memory.ONLINE_BLOCK_KV == {"cpu": 1024, "other": 4096}
    bwd = memory.BACKWARD_TILE_ELEMS
    assert bwd == {"cpu": 1 << 21, "other": 1 << 27}
    assert memory.tile_for(n, heads, 1, 12, 1 << 40, n, "other", target=bwd["other"]) == (192, n, heads)
    assert memory.tile_for(n, heads, 1, 12, 1 << 40, n, "cpu", target=bwd["cpu"]) == (64, n, 1)  # 73 pairs
    assert memory.FREE_FRACTION == {"cpu": 0.5, "other": 0.7}


def test_cpu_forward_tiles_keep_a_heads_scores_near_l2():
    """Heads of at most 64 dims: every head in the tile, at most HEAD_TILE_ELEMS = 2^19 scores (2 MB of fp32) a head
    where that leaves 64 rows: N = 2048, 8 heads take 256 rows (2^22 scores, not the 512 rows of 2^23, 1.15x slower
    quiet); Wan 480p takes 80 rows of 24 heads (349K scores a head); GPUs have no cap; the backward's target has
    none either."""
    assert memory.TARGET_TILE_ELEMS == {"cpu": 1 << 23, "other": 1 << 27}
    assert memory.HEAD_TILE_ELEMS == {"cpu": 1 << 19, "other": None}
    assert memory.HEAD_CAP_MAX_DIM == 64
    assert memory.tile_for(2048, 8, 1, 4, 1 << 40, 2048, "cpu", head_dim=64) == (256, 2048, 8)
    assert memory.tile_for(2048, 8, 1, 4, 1 << 40, 2048, "cpu", head_dim=32) == (256, 2048, 8)
    assert memory.tile_for(2048, 8, 1, 4, 1 << 40, 2048, "other", head_dim=64) == (2048, 2048, 8)
    assert memory.tile_for(4290, 24, 1, 4, 1 << 40, 4290, "cpu", head_dim=64) == (80, 4290, 24)
    assert memory.tile_for(2048, 8, 1, 12, 1 << 40, 2048, "cpu", target=1 << 21, head_dim=64) == (128, 2048, 8)
    # a batch of 4 counts as 4 rows a pair: 2^19 / (4 x 2048) = 64 rows
    assert memory.tile_for(2048, 8, 4, 4, 1 << 40, 2048, "cpu", head_dim=64) == (64, 2048, 8)


def test_cpu_forward_tiles_of_128_dim_heads_have_no_head_cap():
    """Heads of 128 dims (every video model's) take the whole 2^23 target: at N = 4096, 8 heads, 256 rows, not the
    128 the cap would leave (no faster quiet, 10-20 % slower with the CPU loaded: issue 24.3); an unknown head dim
    has no cap either. The engine passes the call's head dim: a 128-dim call of that shape plans 256 rows."""
    assert memory.tile_for(4096, 8, 1, 4, 1 << 40, 4096, "cpu", head_dim=128) == (256, 4096, 8)
    assert memory.tile_for(4096, 8, 1, 4, 1 << 40, 4096, "cpu", head_dim=65) == (256, 4096, 8)
    assert memory.tile_for(4096, 8, 1, 4, 1 << 40, 4096, "cpu") == (256, 4096, 8)
    assert memory.tile_for(4096, 8, 1, 4, 1 << 40, 4096, "cpu", head_dim=64) == (128, 4096, 8)
    from attention_core.kernel.numerics import choose_numerics
    from attention_core.kernel.problem import normalize
    for dim, rows in ((128, 256), (64, 128)):
        q = torch.zeros(1, 8, 4096, dim)
        p = normalize(q, q, q)
        plan = memory.plan_forward(p, choose_numerics(p.dtype, p.device), "chunked", 1 << 40)
        assert (plan.block_q, plan.block_h) == (rows, 8), dim


def test_cpu_forward_tiles_of_large_heads_take_rows_in_balanced_head_groups():
    """CPU forward tiles of heads over 64 dims keep FORWARD_PREF_ROWS = 256 rows a head, in head groups that are a
    multiple of the thread count and even (issue 38.6: at the Wan 2.2 480p shape 80 rows of all 24 heads ran
    1.2-1.35x torch's fused kernel, 320 rows of 6 heads 1.08-1.12x; 3 heads on 2 threads 1.39x). 2^23 / 4,290 = 1,955
    pairs: 7 heads of 256 rows -> 6 (a multiple of 2, four even groups) -> rows filling the target, 325 -> 320. With
    4 threads 4 heads (six groups) of 480 rows; 16 threads: 7 heads, fewer than the threads, evened to 6. GPUs, the
    backward and heads of 64 dims keep the old rule."""
    assert memory.FORWARD_PREF_ROWS == {"cpu": 256, "other": memory.PREF_ROWS}
    n = 4290
    assert memory.tile_for(n, 24, 1, 4, 1 << 40, n, "cpu", head_dim=128, threads=2) == (320, n, 6)
    assert memory.tile_for(n, 24, 1, 4, 1 << 40, n, "cpu", head_dim=128, threads=4) == (480, n, 4)
    assert memory.tile_for(n, 24, 1, 4, 1 << 40, n, "cpu", head_dim=128, threads=16) == (320, n, 6)
    assert memory.tile_for(n, 40, 1, 4, 1 << 40, n, "cpu", head_dim=128, threads=2) == (320, n, 6)
    assert memory.tile_for(n, 24, 1, 4, 1 << 40, n, "cpu", head_dim=64, threads=2) == (80, n, 24)
    assert memory.tile_for(n, 24, 1, 4, 1 << 40, n, "other", head_dim=128, threads=2) == (1296, n, 24)
    assert memory.tile_for(n, 24, 1, 12, 1 << 40, n, "cpu", target=1 << 21, head_dim=128, threads=2) == (64, n, 7)
    # the budget still bounds the tile: 1,000 pairs' worth of bytes -> 2 heads of 496 rows
    assert memory.tile_for(n, 24, 1, 4, 1000 * n * 4, n, "cpu", head_dim=128, threads=2) == (496, n, 2)
    assert [memory.balanced_heads(h, 24, 2) for h in (1, 2, 3, 5, 7, 9, 13, 24, 30)] == \
        [1, 2, 2, 4, 6, 8, 12, 24, 24]
    assert [memory.balanced_heads(h, 40, 2) for h in (7, 14, 20)] == [6, 14, 20]
    assert memory.balanced_heads(7, 14, 2) == 6 and memory.balanced_heads(7, 14, 4) == 4  # never an odd 5 + 5 + 4
    assert memory.balanced_heads(7, 24, 16) == 6 and memory.balanced_heads(5, 24, 1) == 5
    # the engine plans it with torch's thread count
    from attention_core.kernel.numerics import choose_numerics
    from attention_core.kernel.problem import normalize
    q = torch.zeros(1, 24, n, 128)
    p = normalize(q, q, q)
    plan = memory.plan_forward(p, choose_numerics(p.dtype, p.device), "chunked", 1 << 40)
    assert (plan.block_q, plan.block_h) == memory.tile_for(n, 24, 1, 4, 1 << 40, n, "cpu", head_dim=128,
                                                           threads=torch.get_num_threads())[::2]


def test_a_head_split_tile_writes_into_the_calls_output():
    """A plan that splits the heads (8 heads of 128 dims, a budget of 512 pairs of 512 keys: 2 heads x 256 rows a
    tile, four groups) runs each group's tier into the call's own output: LiveBytes sees the output (8 MB: values
    512 wide) plus 3.3 MB (one tile's S and P, 1 MB, its P V product, 1 MB, query rows and K/V), not also a group
    output copied over (5.3 MB before), and the result is the one-tile answer, every head in its place."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 8, 512, 128, generator=g), torch.randn(1, 8, 512, 128, generator=g)
    v = torch.randn(1, 8, 512, 512, generator=g)
    budget = 512 * 512 * 4  # 512 (head, row) pairs of 512 keys at the CPU chunked tier's 4 bytes a score
    from attention_core.kernel.numerics import choose_numerics
    from attention_core.kernel.problem import normalize
    p = normalize(q, k, v)
    plan = memory.plan_forward(p, choose_numerics(p.dtype, p.device), "chunked", budget)
    assert (plan.block_q, plan.block_h) == (256, 2)
    with torch.no_grad():
        whole, _ = ops.attention_forward(q, k, v, tier="chunked", block_q=512)
        split, _ = ops.attention_forward(q, k, v, tier="chunked", memory_budget=budget)
        peak = peak_bytes(ops.attention_forward, q, k, v, tier="chunked", memory_budget=budget)
    assert torch.allclose(split, whole, rtol=1e-5, atol=1e-6)
    out_bytes = 8 * 512 * 512 * 4
    assert peak - out_bytes <= 4 * MB, f"{(peak - out_bytes) / MB:.2f} MB beyond the output"


def test_a_tile_of_every_head_fills_the_calls_output_without_a_second_one():
    """When one tile holds every kv head (4 heads x 256 x 256 scores here), the tier fills the call's output
    itself: LiveBytes sees the output (2 MB: values 512 wide), the tile's S and P (2 MB) and its P V product (2 MB,
    4.3 MB beyond the output in all), not also a second 2 MB output assembled from one head group."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 256, 64, generator=g), torch.randn(1, 4, 256, 64, generator=g)
    v = torch.randn(1, 4, 256, 512, generator=g)
    with torch.no_grad():
        peak = peak_bytes(ops.attention_forward, q, k, v, tier="chunked")
    out_bytes = 4 * 256 * 512 * 4
    assert peak - out_bytes <= 5 * MB, f"{(peak - out_bytes) / MB:.2f} MB beyond the output"

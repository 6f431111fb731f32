"""attention_core.plan's per-call totals against the bytes the engine really holds (LiveBytes), on the CPU.

The plan (and the Attention Fit node) promises the memory one attention call needs beyond q, k, v and its
output. That must include what the engine adds besides the score tile: contiguous copies of K and V when they
arrive in ComfyUI's layout ([B, N, H*D] viewed as heads), fp32 copies when half inputs compute in fp32 (the CPU
default), and a head group's own output when a tile splits the heads. Measured for both layouts, each dtype mode
(as tests/engine/test_memory_estimates.py), full-row and online tiles, with all heads in one tile and a head split.
Bound: the measured figure is at most the plan's total plus the per-row tensors (the query tile converted then
scaled, the output tile, row statistics: SLACK_ROWS fp32 rows of D per tile row), and at least half of it (fp16
tiles are planned at 4 bytes a score for the overflow guard).
"""
import pytest
import torch

from attention_core.kernel import ops
from attention_core import plan
from live_bytes import peak_bytes

B, H, N, D = 1, 8, 1024, 64
SLACK_ROWS = 6
NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
MODES = [(torch.float32, "auto"), (torch.float16, "input"), (torch.bfloat16, "input"), (torch.float16, "auto")]


def _inputs(layout, dtype):
    g = torch.Generator().manual_seed(0)
    if layout == "heads":
        return [torch.randn(B, H, N, D, generator=g).to(dtype) for _ in range(3)]
    # ComfyUI's optimized_attention: [B, N, H*D] -> reshape(b, -1, heads, dim).transpose(1, 2)
    return [torch.randn(B, N, H * D, generator=g).to(dtype).reshape(B, -1, H, D).transpose(1, 2) for _ in range(3)]


CASES = [("chunked", 64 << 20), ("chunked", 3 << 19), ("online", 64 << 20)]  # all heads, a head split (1.5 MB)


@pytest.mark.parametrize("tier,budget", CASES, ids=["chunked", "chunked-head-split", "online"])
@pytest.mark.parametrize("dtype,precision", MODES, ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("layout", plan.LAYOUTS)
def test_plan_total_bounds_what_the_call_holds(layout, dtype, precision, tier, budget, monkeypatch):
    monkeypatch.setitem(plan.MODELS, "test", plan.ModelSpec("test", "test", (1, 1, 1), (1, 1, 1), H, D, 4 * H * D,
                                                            1, "a 1,024-token test shape"))
    est = plan.estimate("test", 32, 32, 1, free=2 * budget, dtype_bytes=dtype.itemsize, cpu=True,
                        dtype=NAMES[dtype], precision=precision, layout=layout)
    assert est["tokens"] == N and est["budget"] == budget
    planned = est["tiers"][tier]
    q, k, v = _inputs(layout, dtype)
    held = peak_bytes(lambda: ops.attention_forward(q, k, v, tier=tier, precision=precision, memory_budget=budget))
    held -= B * H * N * (D * dtype.itemsize + 2 * 4)  # the output and its fp32 row statistics (L, row max)
    slack = SLACK_ROWS * B * planned["tile"]["heads"] * planned["tile"]["rows"] * D * 4
    assert planned["total"] / 2 <= held <= planned["total"] + slack, (
        f"{layout} {NAMES[dtype]} precision={precision} {tier}: the call holds {held / 2**20:.2f} MB beyond q, k, "
        f"v and the output; the plan says {planned['total'] / 2**20:.2f} MB (tile {planned['tile']})")


def test_wan_720p_counts_the_kv_copies():
    """Wan 2.2 5B 720p in ComfyUI's layout, fp16 on a GPU: K and V are copied contiguous once, 2 x 24 x 28,520 x
    128 x 2 bytes = 350 MB on top of the tile."""
    est = plan.estimate("wan22-5b", 1280, 720, 121, free=32 << 30, dtype_bytes=2)
    t = est["tiers"]["chunked"]
    assert t["copies"] == 2 * 24 * 28520 * 128 * 2
    assert t["total"] == t["copies"] + t["tile"]["bytes"]
    assert "K/V copies" in plan.report(est)
    heads = plan.estimate("wan22-5b", 1280, 720, 121, free=32 << 30, dtype_bytes=2, layout="heads")
    assert heads["tiers"]["chunked"]["copies"] == 0

"""The planner's bytes per score (memory.bytes_per_score) against the bytes the tiers really hold, on the CPU.

Tiles are sized as budget / bytes-per-score, so an estimate below the real figure overruns the budget (out of
memory on the GPU) and one far above it makes tiles needlessly small (slow). The real figure is measured with
LiveBytes (a dispatch mode that tracks every tensor's storage): the growth of the peak between 16-row and 256-row
query tiles, divided by the growth in scores, leaves out what does not scale with the tile (inputs, outputs, K/V
copies). Bound: real <= estimate + the per-row vectors (query and output rows, the online tier's accumulator and
P V rows, row max and sums: at most 192 bytes a row at head dim 8, over the tile's keys) and real >= estimate / 2.
fp16 tiles kept in fp16 are measured with inputs whose scores the overflow guard flags (every tile computed in fp32
and cast back): the worst case the planner sizes them by.
"""
import pytest
import torch

from attention_core.kernel import memory, ops
from live_bytes import peak_bytes

N, E, H = 2048, 8, 2
SMALL, LARGE = 16, 256

DTYPES = [  # (input dtype, precision): fp32; half kept as half; fp16 computed in fp32 (the CPU default)
    (torch.float32, "auto"), (torch.float16, "input"), (torch.bfloat16, "input"), (torch.float16, "auto")]


def _inputs(dtype, mask, guarded=False):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, N, E, generator=g).to(dtype) for _ in range(3))
    if guarded:  # |q| |k| scale ~ 300 x 300 x 8 / sqrt(8): past the guard's bound on every tile
        q, k = q * 300, k * 300
    if mask == "float":
        am = torch.randn(1, 1, N, N, generator=g).to(dtype)
    elif mask == "bool":
        am = torch.rand(1, 1, N, N, generator=g) > 0.3
    else:
        am = None
    return q, k, v, am


@pytest.fixture
def estimates(monkeypatch):
    """Every value memory.bytes_per_score returns while planning, in order."""
    seen = []
    real = memory.bytes_per_score

    def spy(*a, **kw):
        seen.append(real(*a, **kw))
        return seen[-1]
    monkeypatch.setattr(memory, "bytes_per_score", spy)
    return seen


@pytest.mark.parametrize("dtype,precision", DTYPES, ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["nodrop", "dropout"])
@pytest.mark.parametrize("mask", [None, "float", "bool"], ids=["nomask", "floatmask", "boolmask"])
@pytest.mark.parametrize("tier", ["chunked", "inplace", "online", "backward"])
def test_bytes_per_score_bounds_what_the_tiles_hold(tier, mask, dropout, dtype, precision, estimates):
    q, k, v, am = _inputs(dtype, mask, guarded=dtype == torch.float16 and precision == "input")
    kw = dict(attn_mask=am, dropout_p=dropout, dropout_seed=1, precision=precision, flush_to_zero=True)
    block_kv = 512 if tier == "online" else N
    if tier == "backward":
        out, lse = ops.attention_forward(q, k, v, **kw)
        dout = torch.randn_like(q)

        def run(block_q):
            ops.attention_backward(dout, q, k, v, out, lse, block_q=block_q, block_kv=block_kv, **kw)
    else:
        def run(block_q):
            ops.attention_forward(q, k, v, tier=tier, block_q=block_q, block_kv=block_kv, **kw)
    small = peak_bytes(run, SMALL)
    del estimates[:]
    large = peak_bytes(run, LARGE)
    real = (large - small) / ((LARGE - SMALL) * H * block_kv)
    estimate = estimates[-1]
    assert estimate / 2 <= real <= estimate + max(0.25, 192 / block_kv), (
        f"{tier}: the tiles hold {real:.2f} bytes a score, the planner assumes {estimate}")

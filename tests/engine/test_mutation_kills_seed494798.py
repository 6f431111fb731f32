"""Kills for the engine survivors of the fresh draw of seed 494798 (docs/mutation-draws.jsonl): the fp16 guard's
per-tile overflow bound (max|q_i| * scale * max|k_j|, not divided by the scale). Its other survivor, the model
benchmarks' MiB, is killed in test_bench_models_inprocess.py."""
import torch


def test_the_fp16_guard_sends_only_the_tiles_that_could_overflow_to_fp32(monkeypatch):
    """Per query tile, fp16 scores can overflow when max|q_i| * scale * max|k_j| reaches FP16_SAFE: the tile of
    large queries runs in fp32, the tiles of small ones stay fp16 (their bound with the scale divided instead of
    multiplied would not), and the fp32 tile's rows are exact to the output's rounding."""
    from attention_core import scaled_dot_product_attention
    from attention_core.kernel import tiles
    from attention_core.kernel.numerics import FP16_SAFE
    d = 64
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 48, d, generator=g)
    q = q / q.norm(dim=-1, keepdim=True) * 100.0  # |q_i| = 100 ...
    q[:, :, 32:] *= 100.0  # ... and 10,000 in the last tile of 16
    k = torch.randn(1, 1, 40, d, generator=g)
    k = k / k.norm(dim=-1, keepdim=True) * 100.0  # |k_j| = 100
    v = torch.randn(1, 1, 40, d, generator=g)
    scale = d ** -0.5
    assert 100 * scale * 100 < FP16_SAFE <= 100 / scale * 100 and 10_000 * scale * 100 >= FP16_SAFE
    seen = {}
    real = tiles.TileSource.tile_needs_fp32

    def spy(self, i0, i1):
        seen[i0] = real(self, i0, i1)
        return seen[i0]
    monkeypatch.setattr(tiles.TileSource, "tile_needs_fp32", spy)
    q16, k16, v16 = (t.half() for t in (q, k, v))
    out = scaled_dot_product_attention(q16, k16, v16, tier="chunked", block_q=16, precision="fp16")
    assert seen == {0: False, 16: False, 32: True}, seen
    ref = torch.nn.functional.scaled_dot_product_attention(q16.double(), k16.double(), v16.double())
    err = (out.double() - ref).abs()
    assert torch.isfinite(out).all()
    assert float(err[:, :, 32:].max()) < 5e-3  # the fp32 tile: exact to fp16 output rounding

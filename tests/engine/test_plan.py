"""attention_core.plan: token counts against the real latent rules and ComfyUI's own latent nodes, memory
arithmetic against hand-computed values, and the CLI."""
import math

import pytest

from attention_core import plan

GB = 1 << 30


@pytest.mark.parametrize("model,w,h,f,expect", [
    ("wan22-5b", 832, 480, 41, 26 * 15 * 11),      # 52x30 latent -> 26x15 patches, 11 latent frames = 4,290
    ("wan22-5b", 1280, 720, 121, 40 * 23 * 31),    # 45 latent rows pad to 46 -> 23; 31 frames = 28,520
    ("wan-14b", 832, 480, 81, 52 * 30 * 21),       # 8x8x4 VAE: 104x60 latent -> 52x30, 21 frames = 32,760
    ("ltx23-22b", 1280, 704, 129, 40 * 22 * 17),   # 32x32x8 VAE, patch 1: 40x22x17 = 14,960
    ("ltx23-22b", 1920, 1088, 129, 60 * 34 * 17),  # the 1080p workflow's second stage: 34,680
])
def test_tokens_hand_computed(model, w, h, f, expect):
    assert plan.tokens(plan.MODELS[model], w, h, f) == expect


def test_named_token_counts():
    assert plan.tokens(plan.MODELS["wan22-5b"], 832, 480, 41) == 4290
    assert plan.tokens(plan.MODELS["wan22-5b"], 1280, 720, 121) == 28520
    assert plan.tokens(plan.MODELS["wan-14b"], 832, 480, 81) == 32760


def test_tokens_match_comfyui_latent_nodes():
    """The latent each model's own ComfyUI node makes, patched as the DiT patches it, gives plan.tokens."""
    from comfy_harness import require_comfy
    require_comfy()
    import comfy.ldm.common_dit as common_dit
    import torch
    from comfy_extras import nodes_hunyuan, nodes_lt, nodes_wan

    def count(latent, patch):
        x = common_dit.pad_to_patch_size(latent, patch)
        return math.prod(s // p for s, p in zip(x.shape[2:], patch))

    def run(node, **kw):
        out = node.execute(**kw)
        return (out.result if hasattr(out, "result") else out)[0]["samples"]

    for w, h, f in ((832, 480, 41), (1280, 720, 121), (640, 352, 17)):
        lat = run(nodes_wan.Wan22ImageToVideoLatent, vae=None, width=w, height=h, length=f, batch_size=1)
        assert lat.shape[1] == 48
        assert count(lat, (1, 2, 2)) == plan.tokens(plan.MODELS["wan22-5b"], w, h, f)
    lat = run(nodes_hunyuan.EmptyHunyuanLatentVideo, width=832, height=480, length=81, batch_size=1)
    assert count(lat, (1, 2, 2)) == plan.tokens(plan.MODELS["wan-14b"], 832, 480, 81) == 32760
    for w, h, f in ((1280, 704, 129), (1920, 1088, 129)):
        lat = run(nodes_lt.EmptyLTXVLatentVideo, width=w, height=h, length=f, batch_size=1)
        assert count(lat, (1, 1, 1)) == plan.tokens(plan.MODELS["ltx23-22b"], w, h, f)
    del torch


def test_memory_arithmetic_hand_computed():
    # math SDPA, Wan 2.2 5B 480p fp16: 2 x 24 x 4290^2 x 2 bytes
    assert plan.math_bytes(24, 4290, 2) == 2 * 24 * 4290 * 4290 * 2
    # sub-quadratic with 20 GB free, fp32, 24 heads, N 4290: 4 x 24 x 4 x 4096 x 4290 = 6.7 GB <= 20 GB -> 4096 rows
    sq = plan.comfy_subquad(24, 4290, 4, 20 * GB)
    assert (sq["q_chunk"], sq["kv_chunk"], sq["bytes"]) == (4096, 4290, 2 * 24 * 4096 * 4290 * 4)
    # 1 GB free: 1024 rows give 1 GB / (4*24*4*1024) = 2,730 < 4290 keys; 512 rows give 5,461 >= 4290
    assert plan.comfy_subquad(24, 4290, 4, 1 * GB)["q_chunk"] == 512
    tiny = plan.comfy_subquad(24, 28520, 2, 100 * (1 << 20))             # nothing full-row: 512 x sqrt(N)
    assert (tiny["q_chunk"], tiny["kv_chunk"]) == (512, int(math.sqrt(28520)))
    # split: need 3 x 24 x 28520^2 x 2 = 117 GB over 32 GB free -> ratio 3.66 -> 4 slices of 7130 rows
    sp = plan.comfy_split(24, 28520, 2, 32 * GB)
    assert (sp["steps"], sp["rows"], sp["bytes"]) == (4, 7130, 2 * 24 * 7130 * 28520 * 2)
    # N = 4290 over 4 slices does not divide: ComfyUI then runs the whole matrix in one slice
    sp = plan.comfy_split(24, 4290, 4, 2 * GB)
    assert sp["steps"] == 4 and sp["rows"] == 4290
    assert plan.comfy_split(40, 75000, 2, 1 * GB).get("error")
    # FFN: 2 x 4290 x 14336 x 2 bytes, halved by 2 chunks
    assert plan.ffn_bytes(1, 4290, 14336, 2) == 2 * 4290 * 14336 * 2
    assert plan.ffn_bytes(1, 4290, 14336, 2, chunks=2) == 2 * 2145 * 14336 * 2
    # auto chunks: 0.25 of 1 GB per chunk -> ceil(0.246 GB / 0.25 GB) = 1; of 0.5 GB -> 2
    assert plan.ffn_auto_chunks(1, 4290, 14336, 2, 1 * GB) == 1
    assert plan.ffn_auto_chunks(1, 4290, 14336, 2, GB // 2) == 2


def test_pack_tiles_follow_the_planner_budget():
    # chunked fp16 on a GPU: 8 bytes a score (fp32 guard), tile near 2^27 scores, all 24 heads
    t = plan.pack_tile("chunked", 24, 1, 28520, 2, 22 * GB, cpu=False)
    assert t["heads"] == 24 and t["keys"] == 28520
    assert t["bytes"] == 8 * 24 * t["rows"] * 28520 <= 8 * (1 << 27)
    # a budget below one tall tile: fewer heads and rows, never over the budget
    small = plan.pack_tile("chunked", 24, 1, 28520, 2, 64 << 20, cpu=False)
    assert small["bytes"] <= 64 << 20 and small["rows"] * small["heads"] < t["rows"] * t["heads"]
    # online shrinks its key block until 16 rows fit; None below the floor
    assert plan.pack_tile("online", 24, 1, 28520, 2, 16 * 16 * 12, cpu=False)["keys"] == 16
    assert plan.pack_tile("chunked", 24, 1, 28520, 2, 1000, cpu=False) is None
    assert plan.pack_floor("chunked", 28520, 2) == 8 * 16 * 28520


def test_estimate_and_report():
    est = plan.estimate("wan22-5b", 1280, 720, 121, free=32 * GB, dtype_bytes=2)
    assert est["tokens"] == 28520
    assert est["scores"] == 24 * 28520 ** 2 * 2
    assert est["auto_tier"] == "chunked"
    text = plan.report(est)
    assert "28,520 video tokens" in text and "DOES NOT FIT" in text and "recommended" in text
    with pytest.raises(ValueError, match="unknown model"):
        plan.estimate("sdxl", 1, 1, 1, free=GB)


def test_cli(capsys):
    assert plan.main(["--model", "ltx23-22b", "--width", "1920", "--height", "1088", "--frames", "129",
                      "--free-gb", "32"]) == 0
    out = capsys.readouterr().out
    assert "34,680 video tokens" in out and "32 heads x 128" in out
    with pytest.raises(SystemExit):
        plan.main(["--model", "bogus", "--width", "1", "--height", "1", "--frames", "1"])


@pytest.mark.parametrize("tier", ["chunked", "inplace", "online"])
@pytest.mark.parametrize("heads,n,budget", [(24, 4290, 64 << 20), (24, 4290, 8 << 20), (24, 4290, 2 << 30),
                                            (40, 3000, 16 << 20), (2, 500, 1 << 20), (3, 4290, 300 << 10)])
def test_pack_tile_is_the_tile_the_engine_plans(tier, heads, n, budget):
    """The fit report's tile (plan.pack_tile) is the one the engine's planner (memory.plan_forward) takes for the
    same shape, dtype and budget on the CPU: the report describes what will run."""
    import torch

    from attention_core.memory import plan_forward
    from attention_core.numerics import choose_numerics
    from attention_core.problem import normalize
    q = torch.zeros(1, heads, n, 8)
    p = normalize(q, q, q, None, 0.0, False, None, False)
    engine = plan_forward(p, choose_numerics(p.dtype, p.device), tier, budget)
    report = plan.pack_tile(tier, heads, 1, n, 4, budget, cpu=True)
    if engine is None:
        assert report is None
    else:
        assert (report["rows"], report["keys"], report["heads"]) == (engine.block_q, engine.block_kv,
                                                                    engine.block_h)


def test_free_memory_unknown_is_read_as_4_gb(monkeypatch):
    """Where the device reports no free memory, the report assumes 4 GiB (and says where it looked)."""
    import attention_core.memory as memory
    monkeypatch.setattr(memory, "free_memory", lambda dev: None)
    free, where = plan.detected_free()
    assert free == 4 * GB and where


def test_sizes_are_written_in_the_unit_that_reads_best():
    """GB from 0.1 GB up, MB from 0.1 MB up, else KB; two decimals for GB, one for MB and KB."""
    GB, MB = plan.GB, plan.MB
    assert plan._gb(None) == "-"
    assert plan._gb(39 * GB) == "39.00 GB" and plan._gb(0.1 * GB) == "0.10 GB" and plan._gb(1500 * GB) == "1,500.00 GB"
    assert plan._gb(0.1 * GB - 1) == "102.4 MB" and plan._gb(MB) == "1.0 MB" and plan._gb(0.5 * MB) == "0.5 MB"
    assert plan._gb(0.1 * MB) == "0.1 MB" and plan._gb(0.1 * MB - 1) == "102.4 KB" and plan._gb(512) == "0.5 KB"

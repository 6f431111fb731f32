"""attention_core.plan: token counts against the real latent rules and ComfyUI's own latent nodes, memory
arithmetic against hand-computed values, and the CLI."""
import math

import pytest

from attention_core.cli import plan

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
    # Z-Image Turbo: 8x VAE, patch 2, plus the 128 text tokens that join its self-attention
    assert plan.tokens(plan.MODELS["z-image-turbo"], 1024, 1024, 1) == 64 * 64 + 128 == 4224
    assert plan.tokens(plan.MODELS["z-image-turbo"], 1536, 1536, 1) == 96 * 96 + 128 == 9344
    assert plan.preset_shapes("z-image-turbo-1536") == [(9344, 30, 128)]


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
    # chunked fp16 on a GPU: 10 bytes a score (S and P in fp32 under the guard, P cast to fp16), tile near 2^27
    # scores, all 24 heads
    t = plan.pack_tile("chunked", 24, 1, 28520, 2, 22 * GB, cpu=False)
    assert t["heads"] == 24 and t["keys"] == 28520
    assert t["bytes"] == 10 * 24 * t["rows"] * 28520 <= 10 * (1 << 27)
    # a budget below one tall tile: fewer heads and rows, never over the budget
    small = plan.pack_tile("chunked", 24, 1, 28520, 2, 64 << 20, cpu=False)
    assert small["bytes"] <= 64 << 20 and small["rows"] * small["heads"] < t["rows"] * t["heads"]
    # online shrinks its key block until 16 rows fit; None below the floor
    assert plan.pack_tile("online", 24, 1, 28520, 2, 16 * 16 * 6, cpu=False)["keys"] == 16
    assert plan.pack_tile("chunked", 24, 1, 28520, 2, 1000, cpu=False) is None
    assert plan.pack_floor("chunked", 28520, 2) == 10 * 16 * 28520


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


@pytest.mark.parametrize("dim", [8, 128])
@pytest.mark.parametrize("tier", ["chunked", "inplace", "online"])
@pytest.mark.parametrize("heads,n,budget", [(24, 4290, 64 << 20), (24, 4290, 8 << 20), (24, 4290, 2 << 30),
                                            (40, 3000, 16 << 20), (2, 500, 1 << 20), (3, 4290, 300 << 10),
                                            (8, 4096, 1 << 30)])
def test_pack_tile_is_the_tile_the_engine_plans(tier, heads, n, budget, dim):
    """The fit report's tile (plan.pack_tile) is the one the engine's planner (memory.plan_forward) takes for the
    same shape, dtype and budget on the CPU: the report describes what will run (8 heads x 4,096 keys: the per-head
    cap of heads of <= 64 dims halves the rows, 128-dim heads have none)."""
    import torch

    from attention_core.kernel.memory import plan_forward
    from attention_core.kernel.numerics import choose_numerics
    from attention_core.kernel.problem import normalize
    q = torch.zeros(1, heads, n, dim)
    p = normalize(q, q, q, None, 0.0, False, None, False)
    engine = plan_forward(p, choose_numerics(p.dtype, p.device), tier, budget)
    report = plan.pack_tile(tier, heads, 1, n, 4, budget, cpu=True, head_dim=dim)
    if engine is None:
        assert report is None
    else:
        assert (report["rows"], report["keys"], report["heads"]) == (engine.block_q, engine.block_kv,
                                                                    engine.block_h)


def test_free_memory_unknown_is_read_as_4_gb(monkeypatch):
    """Where the device reports no free memory, the report assumes 4 GiB (and says where it looked)."""
    import attention_core.kernel.memory as memory
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


def test_model_geometry_is_comfyuis():
    """Each model's numbers as ComfyUI's model code has them (see ModelSpec.source): attention width = heads x
    head dim, the FFN's hidden width, the layer count (the time estimate multiplies by it), VAE and patch."""
    want = {"wan22-5b": ((4, 16, 16), (1, 2, 2), 24, 128, 3072, 14336, 30),
            "wan-14b": ((4, 8, 8), (1, 2, 2), 40, 128, 5120, 13824, 40),
            "ltx23-22b": ((8, 32, 32), (1, 1, 1), 32, 128, 4096, 16384, 48),
            "z-image-turbo": ((1, 8, 8), (1, 2, 2), 30, 128, 3840, 10240, 30)}
    assert sorted(plan.MODELS) == sorted(want)
    for key, (vae, patch, heads, dim, width, ffn, layers) in want.items():
        m = plan.MODELS[key]
        assert (m.key, m.vae, m.patch, m.heads, m.head_dim, m.width, m.ffn, m.layers) == (
            key, vae, patch, heads, dim, width, ffn, layers)
        assert f"{width}" in m.source and f"{ffn}" in m.source and f"{layers} layers" in m.source


def test_latent_shape_and_smallest_video():
    """Latent frames 1 + (F - 1) // t, rows H // s, columns W // s; the smallest video with a token in every
    sampling stage is one VAE pixel block of one frame at the smallest stage's scale (LTX-2.3's first stage runs
    at half size: 64 x 64); below it estimate() refuses, naming the minimum."""
    wan = plan.MODELS["wan22-5b"]
    assert plan.latent_shape(wan, 832, 480, 41) == (11, 30, 52)
    assert plan.latent_shape(wan, 847, 495, 44) == (11, 30, 52)   # partial VAE blocks and frames are dropped
    assert plan.latent_shape(wan, 848, 496, 45) == (12, 31, 53)
    assert plan.min_size(wan) == (16, 16, 1)
    assert plan.min_size(plan.MODELS["wan-14b"]) == (8, 8, 1)
    assert plan.min_size(plan.MODELS["ltx23-22b"]) == (64, 64, 1)
    assert plan.tokens(plan.MODELS["ltx23-22b"], 32, 32, 1) == 1
    assert plan.tokens(wan, 16, 16, 1) == 1 and plan.tokens(wan, 32, 32, 1) == 1 and plan.tokens(wan, 48, 32, 1) == 2
    with pytest.raises(ValueError) as e:
        plan.estimate("ltx23-22b", 64, 63, 1, free=GB)
    assert str(e.value) == ("attention_core.plan: LTX-2.3 22B (video stream) needs width >= 64, height >= 64 and "
                            "frames >= 1 (its VAE compresses 32x32 pixels into one latent and its stage 1 (half size) "
                            "samples at 0.5 of the size; smaller has no tokens), got 64x63x1")
    with pytest.raises(ValueError, match="got 64x64x0"):
        plan.estimate("ltx23-22b", 64, 64, 0, free=GB)
    with pytest.raises(ValueError, match="got 32x32x1"):  # the full-size stage has a token, the first none
        plan.estimate("ltx23-22b", 32, 32, 1, free=GB)
    with pytest.raises(ValueError, match=r"needs width >= 16, height >= 16 and frames >= 1 \(its VAE compresses "
                                         r"16x16 pixels into one latent; smaller has no tokens\), got 15x16x1"):
        plan.estimate("wan22-5b", 15, 16, 1, free=GB)


@pytest.mark.parametrize("model", sorted(plan.MODELS))
def test_every_sampling_stage_of_the_smallest_size_has_tokens(model):
    """Issue 22.9: plan --model ltx23-22b --width 32 --height 32 --frames 1 was accepted and costed its
    half-size stage at 0 tokens. The smallest size has a token in every stage of the run (as the time estimate
    scales it), and one pixel less in width or height leaves some stage with none."""
    from attention_core.cli import estimate
    spec = plan.MODELS[model]
    w, h, f = plan.min_size(spec)

    def stage_tokens(width, height):
        return [plan.tokens(spec, max(1, int(width * st.scale)), max(1, int(height * st.scale)), f)
                for st in estimate.STAGES[model]]
    assert min(stage_tokens(w, h)) >= 1
    assert min(stage_tokens(w - 1, h)) == 0 and min(stage_tokens(w, h - 1)) == 0
    calib = {"version": 1, "device": "d", "dtype": "fp32", "date": "today",
             "attention": {"pack": [{"tokens": 1, "gflops": 1.0}]}, "gemm": [{"n": 1, "gflops": 1.0}]}
    rt = estimate.run_time(spec, w, h, f, calib, plan.tokens)
    assert all(s["tokens"] >= 1 for s in rt["stages"])
    plan.estimate(model, w, h, f, free=GB)
    for size in ((w - 1, h, f), (w, h - 1, f)):
        with pytest.raises(ValueError, match=f"needs width >= {w}, height >= {h}"):
            plan.estimate(model, *size, free=GB)


def test_cli_refuses_a_size_whose_first_stage_has_no_tokens(capsys):
    """The issue's command: one error line naming the smallest width that works and why; 64 x 64 runs."""
    argv = ["--model", "ltx23-22b", "--width", "32", "--height", "32", "--frames", "1", "--free-gb", "1",
            "--calibration", "/nonexistent/cal.json"]
    with pytest.raises(SystemExit) as e:
        plan.main(argv)
    assert e.value.code == 2 and capsys.readouterr().err == (
        "error: argument --width: LTX-2.3 22B (video stream) needs at least 64 pixels (its VAE compresses 32 pixels "
        "into one latent and its stage 1 (half size) samples at 0.5 of the size, so fewer give no video tokens), "
        "got 32\n")
    assert plan.main(argv[:2] + ["--width", "64", "--height", "64"] + argv[6:]) == 0
    assert "-> 4 video tokens" in capsys.readouterr().out


def test_preset_shapes():
    """The benchmark/tuning presets: (N, heads, head dim), N from the model's latent rules where a model is named."""
    assert plan.preset_shapes("wan22-5b-480p") == [(4290, 24, 128)]
    assert plan.preset_shapes("wan22-5b-720p") == [(28520, 24, 128)]
    assert plan.preset_shapes("wan-14b-480p") == [(32760, 40, 128)]
    assert plan.preset_shapes("ltx23-22b-720p") == [(14960, 32, 128)]
    assert plan.preset_shapes("wan22-5b-4096") == [(4096, 24, 128)]
    assert plan.preset_shapes("reference") == [(1024, 16, 64), (2048, 16, 64), (4096, 16, 64)]
    assert plan.preset_shapes("z-image-turbo-1024") == [(4224, 30, 128)]  # 64 x 64 image + 128 text tokens
    with pytest.raises(ValueError, match=r"unknown preset 'wan'; choose from wan22-5b-480p, wan22-5b-4096, "
                                         r"wan22-5b-720p, wan-14b-480p, ltx23-22b-720p, z-image-turbo-1024, "
                                         r"z-image-turbo-1536, reference"):
        plan.preset_shapes("wan")


@pytest.mark.parametrize("dtype,cpu,precision,compute", [
    ("fp32", False, "auto", "fp32"), ("fp32", False, "fp16", "fp32"), ("fp32", True, "input", "fp32"),
    ("fp16", False, "auto", "fp16"), ("fp16", True, "auto", "fp32"), ("fp16", True, "input", "fp16"),
    ("fp16", False, "fp32", "fp32"), ("bf16", False, "input", "bf16"), ("bf16", True, "input", "bf16"),
    ("bf16", False, "auto", "fp16"), ("bf16", False, "fp16", "fp16"), ("bf16", True, "auto", "fp32"),
    ("bf16", False, "fp32", "fp32"),
])
def test_compute_dtype(dtype, cpu, precision, compute):
    """The tiles' compute dtype (numerics.choose_numerics): fp32 inputs stay fp32; half inputs compute in fp32
    on the CPU under auto and always under fp32; bf16 stays bf16 only under input; else fp16."""
    assert plan.compute_dtype(dtype, cpu, precision) == compute


def test_compute_dtype_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown dtype 'fp8'; choose from fp16, bf16, fp32"):
        plan.compute_dtype("fp8", False)
    with pytest.raises(ValueError, match="unknown precision 'half'; choose from auto, input, fp16, fp32"):
        plan.compute_dtype("fp16", False, "half")
    with pytest.raises(ValueError, match="unknown layout 'bhnd'; choose from comfyui, heads"):
        plan.estimate("wan22-5b", 832, 480, 41, free=GB, layout="bhnd")


def test_bytes_per_score_of_each_tier():
    """chunked: scores + weights (one buffer on the CPU); inplace: one tile; online: one key tile's scores and fp32
    weights, or the weights and their cast; fp16 tiles the overflow guard redoes in fp32 hold fp32 scores and
    their fp16 cast (6 bytes, 10 for chunked's two buffers), bf16 2 bytes a score (6 for online's fp32 weights)."""
    assert [plan.score_bytes(t, "fp32") for t in plan.TIERS] == [8, 4, 4]
    assert [plan.score_bytes(t, "fp16") for t in plan.TIERS] == [10, 6, 6]
    assert [plan.score_bytes(t, "bf16") for t in plan.TIERS] == [4, 2, 6]
    assert [plan.tier_bytes_per_score(t, 2) for t in plan.TIERS] == [10, 6, 6]
    assert [plan.tier_bytes_per_score(t, 4) for t in plan.TIERS] == [8, 4, 4]
    # on the CPU the chunked tier's softmax overwrites its scores: one buffer
    assert [plan.score_bytes(t, "fp32", cpu=True) for t in plan.TIERS] == [4, 4, 4]
    assert [plan.tier_bytes_per_score(t, 2, cpu=True) for t in plan.TIERS] == [6, 6, 6]
    assert [plan.tier_bytes_per_score(t, 8) for t in plan.TIERS] == [16, 8, 8]
    with pytest.raises(ValueError, match="unknown tier 'flash'"):
        plan.tier_bytes_per_score("flash", 2)
    assert plan.pack_floor("inplace", 1000, 2) == 6 * 16 * 1000 and plan.pack_floor("online", 1000, 2) == 6 * 16 * 16


@pytest.mark.parametrize("batch,layout,dtype,compute,all_heads,copied", [
    (1, "comfyui", "fp16", "fp16", True, True),     # ComfyUI's layout is a transposed view: copied
    (1, "heads", "fp16", "fp16", True, False),      # contiguous heads in the compute dtype: read in place
    (1, "heads", "fp16", "fp32", True, True),       # half inputs computed in fp32: converted
    (2, "heads", "fp16", "fp16", False, True),      # a head group of a batch > 1 is a strided slice
    (2, "heads", "fp16", "fp16", True, False),
    (1, "heads", "fp16", "fp16", False, False),     # one batch item's head group is contiguous
])
def test_kv_copies(batch, layout, dtype, compute, all_heads, copied):
    """K and V copied once per call (per head group) in the compute dtype exactly when not already contiguous heads
    of that dtype: 2 x B x H x N x D x the compute dtype's bytes."""
    want = 2 * batch * 8 * 1000 * 64 * (4 if compute == "fp32" else 2) if copied else 0
    assert plan.kv_copy_bytes(batch, 8, 1000, 64, dtype, compute, layout, all_heads) == want


def test_overflow_guard_bytes():
    """fp16 tiles read an fp32 copy of K (then Q) for the row-norm bound, and a tile the guard runs in fp32 reads K
    through an fp32 copy kept for the call: 4 x B x H x N x D bytes; other dtypes none. A call's total counts it
    beside the tile (which holds 6 bytes a score in fp16 inplace: fp32 scores and P cast back to fp16)."""
    assert plan.guard_bytes(2, 8, 1000, 64, "fp16") == 4 * 2 * 8 * 1000 * 64
    assert plan.guard_bytes(2, 8, 1000, 64, "fp32") == 0 and plan.guard_bytes(2, 8, 1000, 64, "bf16") == 0
    # 3 MB free: inplace takes 1 head x 64 rows (sized and held at 6 bytes a score: 1.6 MB of the 2.1 MB budget),
    # the guard's copy of that head of K is 4 x 4,290 x 128 = 2.2 MB, alongside
    t = plan.estimate("wan22-5b", 832, 480, 41, free=3 << 20)["tiers"]["inplace"]
    assert (t["tile"]["heads"], t["tile"]["rows"], t["tile"]["bytes"]) == (1, 64, 6 * 64 * 4290)
    assert t["guard"] == 4 * 4290 * 128
    assert t["total"] == t["copies"] + t["guard"] + t["tile"]["bytes"] + t["rows"]


def test_estimate_budget_and_dtype_defaults():
    """The planner's budget is 0.7 of free memory on a GPU, 0.5 on the CPU; the dtype follows dtype_bytes unless
    given; q, k, v, o of one call are 4 x B x N x width x bytes."""
    gpu = plan.estimate("wan22-5b", 832, 480, 41, free=10 * GB)
    assert gpu["budget"] == 7 * GB and gpu["dtype"] == "fp16" and gpu["compute"] == "fp16"
    cpu = plan.estimate("wan22-5b", 832, 480, 41, free=10 * GB, dtype_bytes=4, batch=3, cpu=True)
    assert cpu["budget"] == 5 * GB and cpu["dtype"] == "fp32" and cpu["batch"] == 3
    assert cpu["qkvo"] == 4 * 3 * 4290 * 3072 * 4 and cpu["scores"] == 3 * 24 * 4290 ** 2 * 4
    assert cpu["math"] == 2 * cpu["scores"] and cpu["latent"] == (11, 30, 52)
    assert cpu["ffn_full"] == 2 * 3 * 4290 * 14336 * 4
    assert plan.estimate("wan22-5b", 832, 480, 41, free=GB, dtype="bf16", precision="input")["compute"] == "bf16"


def test_sub_quadratic_and_split_thresholds():
    """ComfyUI's rules at their edges: a query chunk is taken when free / (4 x bh x e x chunk) >= N exactly, and
    never exceeds N; split takes one slice when 3x the scores fit exactly, 64 slices at most."""
    n, bh, e = 1000, 24, 2
    need = 4 * bh * e * 4096 * n
    assert plan.comfy_subquad(bh, n, e, need)["q_chunk"] == 1000       # min(4096, N)
    assert plan.comfy_subquad(bh, n, e, need - 1)["q_chunk"] == 1000   # 2048 still >= N
    assert plan.comfy_subquad(bh, 5000, e, 4 * bh * e * 4096 * 5000)["q_chunk"] == 4096
    assert plan.comfy_subquad(bh, 5000, e, 4 * bh * e * 4096 * 5000 - 1)["q_chunk"] == 2048
    assert plan.comfy_subquad(bh, 5000, e, 4 * bh * e * 256 * 5000) == {"q_chunk": 256, "kv_chunk": 5000,
                                                                         "bytes": 2 * bh * 256 * 5000 * e}
    assert plan.comfy_subquad(24, 100, 2, 1) == {"q_chunk": 100, "kv_chunk": 10, "bytes": 2 * 24 * 100 * 10 * 2}
    full = 3 * bh * n * n * e
    assert plan.comfy_split(bh, n, e, full) == {"steps": 1, "rows": 1000, "bytes": 2 * bh * n * n * e}
    assert plan.comfy_split(bh, n, e, full - 1)["steps"] == 2 and plan.comfy_split(bh, n, e, full - 1)["rows"] == 500
    assert plan.comfy_split(bh, 1024, e, 3 * bh * 1024 * 1024 * e // 64)["steps"] == 64
    assert plan.comfy_split(bh, 1024, e, 3 * bh * 1024 * 1024 * e // 64)["rows"] == 16
    refused = plan.comfy_split(bh, 1024, e, 3 * bh * 1024 * 1024 * e // 64 - 1)
    assert refused == {"steps": 128, "rows": None, "bytes": None, "error": "refuses: more than 64 slices needed"}


def test_ffn_chunks():
    """Each chunk takes ceil(N / chunks) tokens; auto (chunks 0) gives each chunk a quarter of free memory, at
    least 1 chunk, at most one token a chunk; chunks 0 passed straight through reads as 1."""
    assert plan.ffn_bytes(1, 4291, 10, 2, chunks=2) == 2 * 2146 * 10 * 2
    assert plan.ffn_bytes(2, 4291, 10, 2, chunks=0) == 2 * 2 * 4291 * 10 * 2
    full = plan.ffn_bytes(1, 4290, 14336, 2)
    assert plan.ffn_auto_chunks(1, 4290, 14336, 2, 4 * full) == 1
    assert plan.ffn_auto_chunks(1, 4290, 14336, 2, 4 * full - 4) == 2
    assert plan.ffn_auto_chunks(1, 4290, 14336, 2, 0) == 4290


def test_pack_tile_online_keys_and_kind():
    """Online tiles take at most ONLINE_BLOCK_KV keys (1024 on the CPU, 4096 elsewhere), all N when fewer; the
    GPU's tile targets 2^27 scores, the CPU's 2^23 (one buffer a score there)."""
    assert plan.pack_tile("online", 24, 1, 28520, 2, 32 * GB, cpu=True)["keys"] == 1024
    assert plan.pack_tile("online", 24, 1, 28520, 2, 32 * GB, cpu=False)["keys"] == 4096
    assert plan.pack_tile("online", 24, 1, 900, 2, 32 * GB, cpu=False)["keys"] == 900
    t = plan.pack_tile("chunked", 24, 1, 4096, 4, 32 * GB, cpu=True)
    assert t["heads"] * t["rows"] * t["keys"] <= 1 << 23 < 2 * t["heads"] * t["rows"] * t["keys"]
    assert t["bytes"] == 4 * t["heads"] * t["rows"] * 4096
    t = plan.pack_tile("chunked", 24, 2, 4096, 4, 32 * GB, cpu=False)
    assert t["bytes"] == 8 * 2 * t["heads"] * t["rows"] * 4096 and t["heads"] == 24


@pytest.mark.parametrize("flag,ok,bad", [("--width", "16384", "16385"), ("--height", "16384", "16385"),
                                         ("--frames", "10000", "10001"), ("--batch", "256", "257"),
                                         ("--free-gb", "1000000", "1000001"), ("--free-gb", "0.000001", "0.0000009")])
def test_cli_bounds(flag, ok, bad, capsys):
    """The command line's ranges: sides up to 16,384 pixels, 10,000 frames, batch 256, 0.000001 to 1,000,000 GB."""
    base = {"--model": "wan22-5b", "--width": "16", "--height": "16", "--frames": "1", "--free-gb": "8",
            "--calibration": "/nonexistent/cal.json"}
    argv = [x for kv in {**base, flag: ok}.items() for x in kv]
    assert plan.main(argv) == 0
    capsys.readouterr()
    argv = [x for kv in {**base, flag: bad}.items() for x in kv]
    with pytest.raises(SystemExit) as e:
        plan.main(argv)
    assert e.value.code == 2 and capsys.readouterr().err.startswith(f"error: argument {flag}")


def test_cli_smallest_size_is_accepted(capsys):
    """Exactly the VAE's block (16 x 16 for Wan 2.2 5B) is one token, accepted; one pixel less is refused."""
    argv = ["--model", "wan22-5b", "--width", "16", "--height", "16", "--frames", "1", "--free-gb", "1",
            "--calibration", "/nonexistent/cal.json"]
    assert plan.main(argv) == 0
    assert "-> 1 video tokens" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        plan.main(argv[:5] + ["15"] + argv[6:])
    assert "error: argument --height: Wan 2.2 TI2V 5B needs at least 16 pixels (its VAE compresses 16 pixels into " \
           "one latent, so fewer give no video tokens), got 15" in capsys.readouterr().err


@pytest.mark.parametrize("steps,ok", [("1,1", True), ("10000,3", True), ("0,3", False), ("20,10001", False),
                                      ("20", False), ("20,3,1", False), ("a,b", False)])
def test_cli_steps(steps, ok, capsys):
    """--steps: one count per sampling stage of the model (LTX-2.3: two), each from 1 to 10,000."""
    argv = ["--model", "ltx23-22b", "--width", "64", "--height", "64", "--frames", "1", "--free-gb", "1",
            "--calibration", "/nonexistent/cal.json", "--steps", steps]
    if ok:
        assert plan.main(argv) == 0
        return
    with pytest.raises(SystemExit) as e:
        plan.main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        f"error: argument --steps: give 2 comma-separated step count(s) from 1 to 10000 for ltx23-22b "
        f"(stage 1 (half size), stage 2 (full size)), got {steps!r}\n")


def test_time_report_reads_the_calibration_of_the_tiles_dtype(profdir, monkeypatch):
    """Without --calibration the time section reads this device's calibration for the tiles' compute dtype:
    --cpu (or a CPU-only machine) the CPU's fp32 one for fp16 inputs under auto; a GPU's fp16 one."""
    from attention_core.device import calibration
    from attention_core.cli import cli_args
    est = plan.estimate("wan22-5b", 832, 480, 41, free=8 * GB)
    cpu_path = calibration.calibration_path("cpu", "fp32")
    assert f"no calibration of this device at {cpu_path}" in plan.time_report(est, cpu=True)
    monkeypatch.setattr(cli_args, "default_device", lambda: "cpu")
    assert f"no calibration of this device at {cpu_path}" in plan.time_report(est)
    seen = []
    monkeypatch.setattr(calibration, "calibration_path", lambda dev, dt: seen.append((dev, dt)) or "/x/c.json")
    plan.time_report(est, device="cuda")
    plan.time_report(plan.estimate("wan22-5b", 832, 480, 41, free=GB, dtype="bf16", precision="input"), cpu=True)
    assert seen == [("cuda", "fp16"), ("cpu", "bf16")]


def test_head_split_of_a_batch():
    """Batch 2, 16 MB free on a GPU: chunked takes 2 of the 24 heads (64 rows); the call then holds both batch
    items' K/V copies of those heads (2 x 2 x 2 x 4,290 x 128 x 2 B; the group's results go straight into the
    call's output: no group output is held), the fp16 guard's fp32 copy of K (4 x 2 x 2 x 4,290 x 128 B),
    the tile (10 bytes a score: S and P in fp32 under the guard, P cast to fp16) and its rows (plan.row_bytes);
    inplace (6 bytes a score) takes a 3-head group."""
    est = plan.estimate("wan22-5b", 832, 480, 41, free=16 << 20, batch=2)
    c = est["tiers"]["chunked"]
    assert c["tile"] == {"rows": 64, "keys": 4290, "heads": 2, "bytes": 10 * 2 * 2 * 64 * 4290}
    assert c["copies"] == 2 * 2 * 2 * 4290 * 128 * 2
    assert "group_out" not in c
    assert c["guard"] == 4 * 2 * 2 * 4290 * 128 and c["rows"] == 2 * 2 * 64 * (14 * 128 + 32)
    assert c["total"] == c["copies"] + c["guard"] + c["tile"]["bytes"] + c["rows"]
    i = est["tiers"]["inplace"]
    assert i["tile"]["heads"] == 3 and i["total"] == 2 * 2 * 3 * 4290 * 128 * 2 + \
        4 * 2 * 3 * 4290 * 128 + 6 * 2 * 3 * 64 * 4290 + 2 * 3 * 64 * (14 * 128 + 32)


def test_sub_quadratic_takes_each_listed_chunk():
    """Each of ComfyUI's query chunks (4096, 2048, 1024, 512, 256) is taken exactly when 4 x bh x e x chunk x N
    bytes fit."""
    bh, e, n = 24, 2, 5000
    for x in plan.COMFY_SUBQUAD_CHUNKS:
        assert plan.comfy_subquad(bh, n, e, 4 * bh * e * x * n)["q_chunk"] == x
    assert plan.COMFY_SUBQUAD_CHUNKS == (4096, 2048, 1024, 512, 256)
    assert plan.comfy_subquad(bh, n, e, 4 * bh * e * 256 * n - 1) == {"q_chunk": 512, "kv_chunk": 70,
                                                                       "bytes": 2 * bh * 512 * 70 * e}


def test_detected_free_memory_on_a_gpu(monkeypatch):
    """With a GPU, free memory is the first GPU's, named in the report."""
    import torch

    import attention_core.kernel.memory as memory
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "Test Card 48GB")
    monkeypatch.setattr(memory, "free_memory", lambda dev: 7 * GB if dev.type == "cuda" else None)
    assert plan.detected_free() == (7 * GB, "GPU Test Card 48GB")


def test_cli_help_names_the_tool_and_its_ranges(capsys):
    """--help: the module docstring's first line as the description, and each flag's range."""
    with pytest.raises(SystemExit) as e:
        plan.main(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Will it fit: tokens and per-call memory of a video model's attention" in out  # (argparse wraps it)
    assert "before running anything." in out
    assert "free memory in GB, 0.000001 to 1,000,000 (default: detected)" in out
    assert "pixels, up to 16384" in out and "up to 10000" in out and "up to 256" in out


def test_cli_blocks_times_a_step_of_that_many_blocks_and_each_block(tmp_path, capsys):
    """Issue 24.4: `--blocks 1` times a step of one block, to compare with `./dev demo` (one real-width block at
    832x480, 21 frames: 2,340 tokens, CFG); every method's line gives the time per step and per block. Without
    --blocks every layer runs, and the time per block is the same."""
    from attention_core.device import calibration
    from attention_core.cli import estimate
    path = str(tmp_path / "cal.json")
    calib = {"version": 1, "device": "Test CPU", "dtype": "fp32", "date": "2026-12-01 12:00 UTC",
             "attention": {"pack": [{"tokens": 1024, "gflops": 40.0}, {"tokens": 4096, "gflops": 30.0}],
                           "subquad": [{"tokens": 1024, "gflops": 50.0}, {"tokens": 4096, "gflops": 20.0}]},
             "gemm": [{"m": 512, "k": 3072, "n": 3072, "gflops": 274.0}, {"m": 4096, "k": 3072, "n": 3072,
                                                                           "gflops": 180.0}],
             "elementwise": [{"rows": 4096, "width": 3072, "gbps": 9.5}]}
    calibration.save(calib, path)
    base = ["--model", "wan22-5b", "--width", "832", "--height", "480", "--frames", "21", "--dtype", "fp32", "--cpu",
            "--free-gb", "8", "--calibration", path]
    spec = plan.MODELS["wan22-5b"]

    def method_lines(out):
        return [ln.strip() for ln in out.splitlines() if ln.strip().startswith(tuple(estimate.METHODS.values()))
                and "a step" in ln]
    assert plan.main(base + ["--blocks", "1"]) == 0
    one = capsys.readouterr().out
    assert "time (calibration of Test CPU, fp32, 2026-12-01 12:00 UTC; 1 of its 30 blocks a step):" in one
    assert "sampling: 832x480, 2,340 tokens, 20 steps, batch 2 (CFG)" in one
    assert "at 9.5 GB/s (measured)" in one
    assert plan.main(base) == 0
    full = capsys.readouterr().out
    assert "; all 30 blocks a step):" in full
    for m, line1, line30 in zip(estimate.METHODS, method_lines(one), method_lines(full)):
        t1 = estimate.step_time(spec, 2340, calib, m, batch=2, blocks=1)
        t30 = estimate.step_time(spec, 2340, calib, m, batch=2)
        d = estimate._dur
        assert line1.endswith(f"{d(t1['total'])} a step, {d(t1['total'])} a block (attention {d(t1['attention'])}, "
                              f"GEMMs {d(t1['gemm'])}, elementwise {d(t1['elementwise'])}); "
                              f"{d(20 * t1['total'])} for the stage"), line1
        assert line30.endswith(f"{d(t30['total'])} a step, {d(t30['block'])} a block (attention "
                               f"{d(t30['attention'])}, GEMMs {d(t30['gemm'])}, elementwise {d(t30['elementwise'])}); "
                               f"{d(20 * t30['total'])} for the stage"), line30
        assert t30["block"] == pytest.approx(t1["total"], rel=1e-12)
    assert plan.main(["--model", "ltx23-22b", "--width", "64", "--height", "64", "--frames", "1", "--free-gb", "1",
                      "--calibration", path, "--blocks", "48"]) == 0  # LTX-2.3's 48 blocks: all of them
    assert "; all 48 blocks a step):" in capsys.readouterr().out


def test_cli_help_names_the_blocks_of_each_model(capsys):
    with pytest.raises(SystemExit):
        plan.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "default: all of the model's (wan22-5b 30, wan-14b 40, ltx23-22b 48, z-image-turbo 30)" in out

"""`python -m attention_core.plan`'s text: every number, unit, threshold and advice line a user reads.

The report is the product of the fit planner: a user decides from it whether a video fits and what to set. So the
whole text of the module docstring's own example is pinned (each figure checked by hand in the comments), and then
each branch the example does not reach: the split refusal, the "no slicing" note, a head-split tile's extra
lines, a run where nothing fits, the fp32 and contiguous-heads wording, and the command line's own lines."""
import pytest

from attention_core.kernel import memory
from attention_core.cli import plan

GB, MB = plan.GB, plan.MB
NO_CAL = "/nonexistent/calibration.json"  # the time section then only says there is no calibration

# python -m attention_core.plan --model wan22-5b --width 1280 --height 720 --frames 121 --free-gb 32 (fp16, GPU)
#   latent 1 + 120 // 4 = 31 frames, 720 // 16 = 45 rows, 1280 // 16 = 80 columns; patch 1x2x2 pads 45 up to 46:
#   31 x 23 x 40 = 28,520 tokens
#   scores 24 x 28,520^2 x 2 B = 36.36 GiB; math SDPA twice that, 72.72 GiB > 32: DOES NOT FIT
#   sub-quadratic: 4 x 24 x 2 x 4096 x 28,520 = 22.4 GB <= 32 GB, so 4096 query rows of full keys:
#     2 x 24 x 4096 x 28,520 x 2 B = 10.44 GiB
#   split: 3 x 36.36 = 109.1 GiB over 32 -> 3.41 -> 4 slices; 28,520 / 4 = 7,130 rows: 18.18 GiB
#   chunked (the engine sizes fp16 tiles at 8 B a score): ~2^27 scores over 24 heads x 28,520 keys -> 192 rows;
#     it holds up to 10 B a score (a tile the overflow guard runs in fp32: S and P in fp32, P cast to fp16):
#     10 x 24 x 192 x 28,520 = 1.22 GiB; inplace the same tile at 6 B, 0.73 GiB; online 10 B x 24 x 1360 x 4096
#     = 1.25 GiB; K/V copied contiguous from ComfyUI's layout: 2 x 24 x 28,520 x 128 x 2 B = 0.33 GiB; the
#     guard's fp32 K 4 x 24 x 28,520 x 128 = 0.33 GiB; rows (plan.row_bytes, fp16): chunked and inplace
#     (14 x 128 + 32) x 24 x 192 = 8.0 MiB, online (24 x 128 + 32) x 24 x 1360 = 96.6 MiB
#   floors (the engine's sizing rule): 8 x 16 x 28,520 = 3.5 MiB, 4 x 16 x 28,520 = 1.7 MiB, 12 x 16 x 16 = 3.0 KiB
#   FFN: 2 x 28,520 x 14,336 x 2 B = 1.52 GiB, under a quarter of 32 GB: 1 chunk; q, k, v, o 4 x 28,520 x 3072 x 2
#   = 0.65 GiB; budget 0.7 x 32 = 22.40 GB
WAN_720P_32GB = """\
Wan 2.2 TI2V 5B at 1280x720, 121 frames (fp16/bf16, batch 1, free 32.00 GB)
  latent 31 x 45 x 80 (VAE 4x16x16), patch 1x2x2 -> 28,520 video tokens; 24 heads x 128
  q, k, v in ComfyUI layout; tiles compute in fp16 (precision auto)

  memory of one self-attention call (transient, beyond q, k, v and the output):
    score matrix itself          36.36 GB
    torch math SDPA              72.72 GB   DOES NOT FIT
    ComfyUI sub-quadratic        10.44 GB   (4096 query rows x 28520 keys per chunk at this free memory)
    ComfyUI split                18.18 GB   (4 slice(s) of 7130 rows)
    this pack: chunked           1.22 GB   (24 head(s) x 192 rows x 28520 keys; least it can run with: 4.4 MB)
      + K/V copies 0.33 GB (fp16, 24 head(s)), fp16 guard's fp32 K 0.33 GB, query/output rows 8.0 MB
        -> 1.88 GB in all
    this pack: inplace           0.73 GB   (24 head(s) x 192 rows x 28520 keys; least it can run with: 2.6 MB)
      + K/V copies 0.33 GB (fp16, 24 head(s)), fp16 guard's fp32 K 0.33 GB, query/output rows 8.0 MB
        -> 1.39 GB in all
    this pack: online            24.0 MB   (16 head(s) x 64 rows x 4096 keys; least it can run with: 1.5 KB)
      + K/V copies 0.22 GB (fp16, 16 head(s)), fp16 guard's fp32 K 0.22 GB, query/output rows 3.0 MB
        -> 0.46 GB in all

  feed-forward hidden activation (per block call):
    unchunked                    1.52 GB   (28,520 tokens x 14,336 x 2)
    FFN Chunking (auto)          1.52 GB   (1 chunk(s))
    q, k, v, o of one call       0.65 GB

  recommended:
    Patch Attention mode auto, memory_budget_mb 0 (auto picks 'chunked', tile 1.22 GB of a 22.40 GB budget, \
1.88 GB in all); FFN Chunking chunks 0 (1 at this free memory)
    without the pack: math SDPA needs 72.72 GB > 32.00 GB free; ComfyUI's sub-quadratic fits with 10.44 GB per call"""


def test_the_documented_example_reads_exactly_so():
    """The module docstring's command, 32 GB free: the whole report, line for line."""
    assert plan.report(plan.estimate("wan22-5b", 1280, 720, 121, free=32 * GB)) == WAN_720P_32GB


def test_the_command_line_prints_the_report_then_where_free_memory_came_from(capsys):
    """The CLI prints that same report, then the free-memory source and the batch, then the time section."""
    assert plan.main(["--model", "wan22-5b", "--width", "1280", "--height", "720", "--frames", "121",
                      "--free-gb", "32", "--calibration", NO_CAL]) == 0
    out = capsys.readouterr().out
    assert out.startswith(WAN_720P_32GB + "\n\n  (free memory: given; numbers per attention call and per batch item "
                                          "x 1)\n\n  time per step: no calibration of this device at " + NO_CAL)


def test_the_command_lines_defaults(capsys):
    """Without --dtype/--batch/--precision/--layout: fp16, batch 1, precision auto, ComfyUI's layout (the
    settings of a ComfyUI run); with them, each reaches the report."""
    base = ["--model", "wan22-5b", "--width", "832", "--height", "480", "--frames", "41", "--free-gb", "8",
            "--calibration", NO_CAL]
    assert plan.main(base) == 0
    out = capsys.readouterr().out
    assert "(fp16/bf16, batch 1, free 8.00 GB)" in out
    assert "q, k, v in ComfyUI layout; tiles compute in fp16 (precision auto)" in out
    assert "per batch item x 1)" in out
    assert plan.main(base + ["--dtype", "fp32", "--batch", "3", "--precision", "input", "--layout", "heads"]) == 0
    out = capsys.readouterr().out
    assert "(fp32, batch 3, free 8.00 GB)" in out
    assert "q, k, v in contiguous heads layout; tiles compute in fp32 (precision input)" in out
    assert "per batch item x 3)" in out
    # fp32: the score matrix is 3 x 24 x 4,290^2 x 4 bytes
    assert f"score matrix itself          {plan._gb(3 * 24 * 4290 ** 2 * 4)}" in out
    assert plan.main(base + ["--dtype", "bf16", "--precision", "input", "--cpu"]) == 0
    out = capsys.readouterr().out  # bf16 kept under "input" even on the CPU; 2 bytes an element
    assert "(fp16/bf16, batch 1" in out and "tiles compute in bf16 (precision input)" in out


def test_free_memory_detected_when_not_given(monkeypatch, capsys):
    """No --free-gb: the report uses the detected free memory and says where it was read."""
    monkeypatch.setattr(plan, "detected_free", lambda: (3 * GB, "GPU Test Card"))
    assert plan.main(["--model", "wan22-5b", "--width", "832", "--height", "480", "--frames", "41",
                      "--calibration", NO_CAL]) == 0
    out = capsys.readouterr().out
    assert "(fp16/bf16, batch 1, free 3.00 GB)" in out and "(free memory: GPU Test Card;" in out


def test_detected_free_memory_on_the_cpu(monkeypatch):
    """Without a GPU, free memory is the RAM available, and the report says so."""
    import torch

    import attention_core.kernel.memory as memory
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(memory, "free_memory", lambda dev: 5 * GB if dev.type == "cpu" else None)
    assert plan.detected_free() == (5 * GB, "CPU RAM (available)")


# ---- the branches the example does not reach ----------------------------------------------------------------

def test_a_head_split_tile_adds_no_group_output_and_fp32_wording(monkeypatch):
    """Wan 2.2 5B 480p fp32 on the CPU, 8 GB, a CPU tile target of 2^19 scores (the default before issue 24): the
    tile takes one head of 112 rows (122 pairs, fewer than FORWARD_PREF_ROWS rows of one head: one head, its rows
    filling the target), so the call also holds K/V copies of one head (2 x 4,290 x 128 x 4 = 4.2 MB) and its 112
    rows' query and output tensors (112 x (3 x 4 x 128 + 32) = 0.2 MB, plan.row_bytes), but no output of the head
    group (the tier writes into the call's output); the budget is half the free memory on a CPU; the CPU's chunked
    tile holds 4 bytes a score (the softmax overwrites the scores)."""
    monkeypatch.setitem(memory.TARGET_TILE_ELEMS, "cpu", 1 << 19)
    est = plan.estimate("wan22-5b", 832, 480, 41, free=8 * GB, dtype_bytes=4, cpu=True)
    assert est["dtype"] == "fp32" and est["budget"] == 4 * GB
    t = est["tiers"]["chunked"]
    assert (t["tile"]["heads"], t["tile"]["rows"], t["tile"]["keys"]) == (1, 112, 4290)
    assert t["tile"]["bytes"] == 4 * 112 * 4290
    assert t["copies"] == 2 * 4290 * 128 * 4
    assert t["rows"] == 112 * (3 * 4 * 128 + 32)
    assert t["total"] == t["copies"] + t["tile"]["bytes"] + t["rows"]
    lines = plan.report(est).splitlines()
    assert lines[0] == "Wan 2.2 TI2V 5B at 832x480, 41 frames (fp32, batch 1, free 8.00 GB)"
    assert "    this pack: chunked           1.8 MB   (1 head(s) x 112 rows x 4290 keys; least it can run with: " \
           "0.3 MB)" in lines
    assert "      + K/V copies 4.2 MB (fp32, 1 head(s)), query/output rows 0.2 MB -> 6.2 MB in all" in lines
    assert not any("head group's output" in line for line in lines)
    # math 3.29 GB fits 8 GB: no DOES NOT FIT, no "without the pack" line; one split slice
    assert "    torch math SDPA              3.29 GB" in lines
    assert "    ComfyUI split                3.29 GB   (1 slice(s) of 4290 rows)" in lines
    assert lines[-1] == ("    Patch Attention mode auto, memory_budget_mb 0 (auto picks 'chunked', tile 1.8 MB of a "
                         "4.00 GB budget, 6.2 MB in all); FFN Chunking chunks 0 (1 at this free memory)")


def test_tight_memory_split_refusal_and_the_q_k_v_o_warning():
    """Wan 14B 720p with 1 GB free: ComfyUI's split would need 2048 slices (it refuses over 64), sub-quadratic
    falls back to 512 rows x sqrt(N) keys, FFN auto needs 16 chunks, and q, k, v, o alone exceed free memory."""
    text = plan.report(plan.estimate("wan-14b", 1280, 720, 81, free=1 * GB))
    lines = text.splitlines()
    assert lines[1] == "  latent 21 x 90 x 160 (VAE 4x8x8), patch 1x2x2 -> 75,600 video tokens; 40 heads x 128"
    assert "    ComfyUI sub-quadratic        21.4 MB   (512 query rows x 274 keys per chunk at this free memory)" \
           in lines
    assert "    ComfyUI split                refuses: more than 64 slices needed (2048)" in lines
    assert "    FFN Chunking (auto)          0.24 GB   (16 chunk(s))" in lines
    assert "    unchunked                    3.89 GB   (75,600 tokens x 13,824 x 2)" in lines
    assert lines[-2] == ("    without the pack: math SDPA needs 851.66 GB > 1.00 GB free; ComfyUI's sub-quadratic fits "
                         "with 21.4 MB per call")
    assert lines[-1] == ("    but q, k, v and o of one call alone take 2.88 GB > 1.00 GB free: the model cannot run "
                         "at this size in this memory (fewer frames, lower resolution, or free memory)")


def test_split_that_cannot_slice_and_a_call_with_no_copies():
    """LTX 720p, batch 2, bf16 kept (precision input), contiguous heads, 2 GB: split needs 64 slices but 14,960
    does not divide by 64, so ComfyUI runs the whole matrix (and says so); no K/V copy and no head split, so each
    tier's line names no K/V copies and its total is the tile and its rows' query and output tensors."""
    est = plan.estimate("ltx23-22b", 1280, 704, 129, free=2 * GB, batch=2, dtype="bf16", precision="input",
                        layout="heads")
    assert est["split"] == {"steps": 64, "rows": 14960, "bytes": 2 * 64 * 14960 ** 2 * 2}
    text = plan.report(est)
    assert ("    ComfyUI split                53.36 GB   (64 slice(s) of 14960 rows; N does not divide by 64: no "
            "slicing)   DOES NOT FIT") in text.splitlines()
    full_rows = ("chunked", "inplace")  # online's smaller tiles split the heads (a group's K/V copied)
    lines = text.splitlines()
    for t in full_rows:
        at = next(i for i, ln in enumerate(lines) if ln.startswith(f"    this pack: {t} "))
        assert lines[at + 1].startswith("      + query/output rows"), lines[at + 1]
    assert "but q, k, v and o" not in text
    assert all(est["tiers"][t]["total"] == est["tiers"][t]["tile"]["bytes"] + est["tiers"][t]["rows"]
               for t in full_rows)
    assert "      + query/output rows 6.2 MB -> 0.46 GB in all" in text.splitlines()  # 2 x 32 x 128 x (6 x 128 + 32)
    assert "    this pack: chunked           0.46 GB   (32 head(s) x 128 rows x 14960 keys; least it can run " \
           "with: 0.9 MB)" in text.splitlines()  # bf16 tiles: 2 x 2 bytes a score (before: counted as fp16's 8)
    assert "    q, k, v, o of one call       0.91 GB" in text.splitlines()  # 4 x 2 x 14,960 x 4096 x 2 B


def test_nothing_fits():
    """2,000 bytes free (a 1,400-byte budget, under even online's 1.5 KB floor): each tier says what it needs, auto
    picks nothing, and the advice is to make the video smaller or free memory. FFN auto chunking stops at one
    token a chunk; sub-quadratic's fallback (512 rows x int(sqrt(28,520)) = 168 keys) does not fit either."""
    est = plan.estimate("wan22-5b", 1280, 720, 121, free=2000)
    assert est["auto_tier"] is None and all(est["tiers"][t]["tile"] is None for t in plan.TIERS)
    lines = plan.report(est).splitlines()
    assert lines[0].endswith("(fp16/bf16, batch 1, free 2.0 KB)")
    assert "    this pack: chunked           does not fit (needs 4.4 MB)" in lines
    assert "    this pack: inplace           does not fit (needs 2.6 MB)" in lines
    assert "    this pack: online            does not fit (needs 1.5 KB)" in lines
    assert ("    ComfyUI sub-quadratic        7.9 MB   (512 query rows x 168 keys per chunk at this free memory)   "
            "DOES NOT FIT") in lines
    assert "    FFN Chunking (auto)          56.0 KB   (28520 chunk(s))" in lines
    assert lines[-2:] == ["  recommended:", "    nothing fits: fewer frames, lower resolution, or free memory "
                                            "(--lowvram, --reserve-vram)"]


def test_auto_takes_the_first_tier_that_fits():
    """Between the chunked and inplace floors, auto picks inplace (chunked, the fastest, does not fit)."""
    floor = plan.pack_floor("chunked", 4290, 2)                      # 8 x 16 x 4,290 bytes
    free = int(floor / 0.7)                                          # budget just under the chunked floor
    est = plan.estimate("wan22-5b", 832, 480, 41, free=free)
    assert est["budget"] < floor and est["tiers"]["chunked"]["tile"] is None
    assert est["auto_tier"] == "inplace"
    assert "(auto picks 'inplace'," in plan.report(est)
    assert plan.estimate("wan22-5b", 832, 480, 41, free=int(floor / 0.7) + 2)["auto_tier"] == "chunked"


@pytest.mark.parametrize("free,fits", [(None, True), (-1, False)])
def test_sub_quadratic_does_not_fit_exactly_above_free(free, fits):
    """"DOES NOT FIT" beside ComfyUI's sub-quadratic (and split) exactly when its bytes exceed free memory."""
    base = plan.estimate("wan22-5b", 832, 480, 41, free=6 * MB)
    need = base["subquad"]["bytes"]
    est = plan.estimate("wan22-5b", 832, 480, 41, free=6 * MB)
    est["free"] = need if free is None else need + free
    line = next(ln for ln in plan.report(est).splitlines() if "ComfyUI sub-quadratic" in ln)
    assert line.endswith("per chunk at this free memory)" if fits else "DOES NOT FIT")
    text = plan.report(est)
    assert ("ComfyUI's sub-quadratic fits with" in text) == fits
    assert ("ComfyUI's sub-quadratic does not fit either" in text) == (not fits)
    sp = plan.estimate("wan22-5b", 832, 480, 41, free=8 * GB, dtype_bytes=4, cpu=True)
    sp["free"] = sp["split"]["bytes"] if free is None else sp["split"]["bytes"] + free
    line = next(ln for ln in plan.report(sp).splitlines() if "ComfyUI split" in ln)
    assert line.endswith("DOES NOT FIT") != fits


def test_q_k_v_o_warning_exactly_above_free():
    """The "q, k, v and o of one call alone" warning appears exactly when they exceed free memory."""
    est = plan.estimate("wan22-5b", 832, 480, 41, free=200 * MB)
    assert est["qkvo"] == 4 * 4290 * 3072 * 2
    est["free"] = est["qkvo"]
    assert "alone take" not in plan.report(est)
    est["free"] = est["qkvo"] - 1
    assert "but q, k, v and o of one call alone take 100.5 MB > 100.5 MB free" in plan.report(est)


def test_non_square_geometry_is_written_time_height_width(monkeypatch, capsys):
    """The shipped models compress and patch height and width alike, so a model whose VAE (2, 4, 8) and patch
    (1, 2, 4) differ per axis shows that the report, the smallest size and the refusals keep time x height x
    width apart: 100x40 pixels, 5 frames -> latent 3 x 10 x 12 -> 3 x 5 x 3 = 45 tokens."""
    monkeypatch.setitem(plan.MODELS, "odd", plan.ModelSpec("odd", "Odd", (2, 4, 8), (1, 2, 4), 2, 8, 64, 1, "test"))
    spec = plan.MODELS["odd"]
    assert plan.min_size(spec) == (8, 4, 1)
    assert plan.latent_shape(spec, 100, 40, 5) == (3, 10, 12) and plan.tokens(spec, 100, 40, 5) == 45
    lines = plan.report(plan.estimate("odd", 100, 40, 5, free=GB)).splitlines()
    assert lines[1] == "  latent 3 x 10 x 12 (VAE 2x4x8), patch 1x2x4 -> 45 video tokens; 2 heads x 8"
    assert plan.estimate("odd", 8, 4, 1, free=GB)["tokens"] == 1
    with pytest.raises(ValueError, match=r"Odd needs width >= 8, height >= 4 and frames >= 1 \(its VAE compresses "
                                         r"8x4 pixels into one latent; smaller has no tokens\), got 7x4x1"):
        plan.estimate("odd", 7, 4, 1, free=GB)
    with pytest.raises(ValueError, match="got 8x3x1"):
        plan.estimate("odd", 8, 3, 1, free=GB)
    for flag, value, least in (("--width", "7", 8), ("--height", "3", 4)):
        argv = ["--model", "odd", "--width", "8", "--height", "4", "--frames", "1", "--free-gb", "1"]
        argv[argv.index(flag) + 1] = value
        with pytest.raises(SystemExit):
            plan.main(argv)
        assert f"error: argument {flag}: Odd needs at least {least} pixels" in capsys.readouterr().err

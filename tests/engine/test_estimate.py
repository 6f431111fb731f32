"""attention_core.estimate (time per step from FLOPs and a calibration) and attention_core.calibrate's file rules.

FLOPs per layer are checked against a hand count from each architecture; the time arithmetic against a
calibration with round rates; the stages against the bundled workflows; the calibration file as untrusted input.
"""
import dataclasses
import json
import math
import logging
import os
import threading

import pytest

from attention_core.device import calibration as calibrate
from attention_core.cli import estimate, plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_wan22_5b_flops_per_layer_hand_count():
    # Wan 2.2 TI2V 5B at 832x480, 41 frames: 11 x 15 x 26 = 4,290 tokens; width 3072 (24 x 128), FFN 14336,
    # 512 T5 text tokens (comfy/ldm/wan/model.py WanAttentionBlock: q, k, v, o Linear(3072, 3072); cross-attention
    # q, o over the video, k, v over the text; ffn Linear(3072, 14336), GELU, Linear(14336, 3072))
    fl = estimate.layer_flops(plan.MODELS["wan22-5b"], 4290)
    assert fl["self_proj"] == 4 * 2 * 4290 * 3072 * 3072            # 323.9 GFLOP
    assert fl["cross_proj"] == 2 * 2 * 4290 * 3072 * 3072 + 2 * 2 * 512 * 3072 * 3072
    assert fl["ffn"] == 2 * 2 * 4290 * 3072 * 14336                  # 755.7 GFLOP
    assert fl["self_attn"] == 2 * 2 * 4290 * 4290 * 3072              # QK^T and PV over 24 heads of 128: 226.2 GFLOP
    assert fl["cross_attn"] == 2 * 2 * 4290 * 512 * 3072
    assert round(sum(fl.values()) / 1e9) == 1514  # 323.9 + 181.3 + 755.7 + 226.1 + 27.0


def test_ltx23_flops_per_layer_hand_count():
    # LTX-2.3 22B video stream at 1280x704, 129 frames: 17 x 22 x 40 = 14,960 tokens; width 4096 (32 x 128),
    # FeedForward mult 4 (16384), 1024 text tokens
    fl = estimate.layer_flops(plan.MODELS["ltx23-22b"], 14960)
    assert fl["self_proj"] == 8 * 14960 * 4096 ** 2
    assert fl["cross_proj"] == 4 * 14960 * 4096 ** 2 + 4 * 1024 * 4096 ** 2
    assert fl["ffn"] == 4 * 14960 * 4096 * 16384
    assert fl["self_attn"] == 4 * 14960 ** 2 * 4096
    assert fl["cross_attn"] == 4 * 14960 * 1024 * 4096


def _calib(pack=100.0, subquad=50.0, gemm=200.0):
    return {"version": 1, "device": "test device", "dtype": "fp32", "date": "2026-12-01 12:00 UTC",
            "attention": {"pack": [{"tokens": 1024, "gflops": pack}, {"tokens": 4096, "gflops": pack}],
                          "subquad": [{"tokens": 1024, "gflops": subquad}, {"tokens": 4096, "gflops": subquad}]},
            "gemm": [{"m": 512, "k": 3072, "n": 3072, "gflops": gemm}, {"m": 512, "k": 3072, "n": 14336,
                                                                           "gflops": gemm}]}


def test_step_time_is_flops_over_rates():
    spec = plan.MODELS["wan22-5b"]
    fl = estimate.layer_flops(spec, 4290)
    att = fl["self_attn"] + fl["cross_attn"]
    rest = fl["self_proj"] + fl["cross_proj"] + fl["ffn"]
    t = estimate.step_time(spec, 4290, _calib(), "pack", batch=2)
    assert t["attention"] == pytest.approx(30 * 2 * att / 100e9)
    assert t["gemm"] == pytest.approx(30 * 2 * rest / 200e9)
    assert t["rest"] == t["gemm"] + t["elementwise"] and t["total"] == t["attention"] + t["rest"]
    sq = estimate.step_time(spec, 4290, _calib(), "subquad", batch=2, blocks=1)
    assert sq["attention"] == pytest.approx(2 * att / 50e9) and sq["gemm"] == pytest.approx(2 * rest / 200e9)
    assert estimate.step_time(spec, 4290, {**_calib(), "attention": {"pack": [{"tokens": 1, "gflops": 1}]}},
                              "subquad") is None


def test_rates_interpolate_log_log():
    rows = [{"tokens": 1024, "gflops": 10.0}, {"tokens": 4096, "gflops": 40.0}]
    assert estimate._interp(rows, 2048) == pytest.approx(20.0)
    assert estimate._interp(rows, 100) == 10.0 and estimate._interp(rows, 30000) == 40.0


def test_a_measured_token_count_gets_exactly_its_measured_rate():
    """Between measurements the rate is log-log interpolated; at a measured count it is that measurement, bit for
    bit, whichever neighbouring pair the lookup lands in (the rows come unsorted, as a calibration may hold them)."""
    rows = [{"tokens": 4096, "gflops": 7.3}, {"tokens": 1024, "gflops": 3.1}, {"tokens": 2048, "gflops": 5.9},
            {"tokens": 3000, "gflops": 2.7}]
    for r in rows:
        assert estimate._interp(rows, r["tokens"]) == r["gflops"]
    mid = estimate._interp(rows, 2500)
    t = math.log(2500 / 2048) / math.log(3000 / 2048)
    assert mid == pytest.approx(math.exp((1 - t) * math.log(5.9) + t * math.log(2.7)), rel=1e-12)
    assert 2.7 < mid < 5.9
    twice = rows + [{"tokens": 2048, "gflops": 6.3}, {"tokens": 1024, "gflops": 3.3}]  # measured again
    assert estimate._interp(twice, 2048) == pytest.approx(6.1, abs=1e-15)
    assert estimate._interp(twice, 1024) == pytest.approx(3.2, abs=1e-15)
    assert estimate._interp(twice, 1500) == pytest.approx(
        math.exp(math.log(3.2) + math.log(1500 / 1024) / math.log(2) * math.log(6.1 / 3.2)), rel=1e-12)


def _nodes(name):
    with open(os.path.join(ROOT, "workflows", name)) as f:
        return {n["type"]: n.get("widgets_values") for n in json.load(f)["nodes"]}


def test_stages_follow_the_bundled_workflows():
    for name in ("Wan 2.2 5B Text to Video 480p.json", "Wan 2.2 5B Text to Video 720p.json",
                 "Wan 2.2 5B Image to Video 480p.json"):
        ks = _nodes(name)["KSampler"]
        (st,) = estimate.STAGES["wan22-5b"]
        assert (st.steps, st.cfg_batch) == (ks[2], 2 if ks[3] != 1.0 else 1)
    with open(os.path.join(ROOT, "workflows", "LTX-2.3 Text to Video 1080p.json")) as f:
        nodes = json.load(f)["nodes"]
    guiders = [n["widgets_values"][0] for n in nodes if n["type"] == "CFGGuider"]
    sched = next(n["widgets_values"] for n in nodes if n["type"] == "LTXVScheduler")
    sigmas = next(n["widgets_values"][0] for n in nodes if n["type"] == "ManualSigmas").split(",")
    empty = next(n["widgets_values"] for n in nodes if n["type"] == "EmptyLTXVLatentVideo")
    s1, s2 = estimate.STAGES["ltx23-22b"]
    assert (s1.steps, s1.cfg_batch, s2.steps, s2.cfg_batch) == (sched[0], 2, len(sigmas) - 1, 1)
    assert guiders == [4.0, 1.0]
    assert (int(1920 * s1.scale), int(1088 * s1.scale)) == (empty[0], empty[1])  # 960 x 544, then the x2 upsampler


def test_run_time_sums_the_stages():
    rt = estimate.run_time(plan.MODELS["ltx23-22b"], 1920, 1088, 129, _calib(), plan.tokens)
    s1, s2 = rt["stages"]
    assert (s1["tokens"], s2["tokens"]) == (30 * 17 * 17, 60 * 34 * 17)
    expect = 20 * s1["per_step"]["pack"]["total"] + 3 * s2["per_step"]["pack"]["total"]
    assert rt["totals"]["pack"] == pytest.approx(expect)
    assert s2["per_step"]["pack"]["total"] == pytest.approx(
        estimate.step_time(plan.MODELS["ltx23-22b"], 34680, _calib(), "pack", batch=1)["total"])
    with pytest.raises(ValueError, match="2 stage"):
        estimate.run_time(plan.MODELS["ltx23-22b"], 1920, 1088, 129, _calib(), plan.tokens, steps=[20])


def test_report_without_and_with_a_calibration():
    text = estimate.report(plan.MODELS["wan22-5b"], 832, 480, 41, None, "/x/calibration.json")
    assert "no calibration" in text and "python -m attention_core.calibrate" in text and "s a step" not in text
    text = estimate.report(plan.MODELS["wan22-5b"], 832, 480, 41, _calib(), tokens=plan.tokens)
    assert "test device" in text and "2026-12-01" in text and "4,290 tokens" in text
    assert "this pack (auto)" in text and "ComfyUI sub-quadratic" in text and "whole run" in text


def test_plan_cli_prints_the_time(tmp_path, capsys):
    path = str(tmp_path / "cal.json")
    calibrate.save(_calib(), path)
    args = ["--model", "wan22-5b", "--width", "832", "--height", "480", "--frames", "41", "--free-gb", "16"]
    assert plan.main(args + ["--calibration", path, "--steps", "10"]) == 0
    out = capsys.readouterr().out
    assert "10 steps" in out and "test device" in out and " a block (attention " in out
    assert plan.main(args + ["--calibration", str(tmp_path / "none.json")]) == 0
    assert "no calibration" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        plan.main(args + ["--steps", "20,3"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith("error: argument --steps")


@pytest.mark.parametrize("content", ["{not json", "[]", '{"version": 1}', json.dumps({**_calib(), "gemm": []}),
                                     json.dumps({**_calib(), "attention": {"pack": [{"tokens": 0, "gflops": 5}]}}),
                                     json.dumps({**_calib(), "attention": {"pack": [{"tokens": 9, "gflops": "x"}]}}),
                                     json.dumps({**_calib(), "date": 5})])
def test_bad_calibration_is_absent_with_one_warning(tmp_path, caplog, content):
    path = tmp_path / "calibration.json"
    path.write_text(content)
    with caplog.at_level(logging.WARNING):
        assert calibrate.load(str(path)) is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage()


def test_concurrent_writers_never_show_a_broken_file(tmp_path):
    path = str(tmp_path / "calibration.json")
    calibrate.save(_calib(), path)
    errors = []

    def write(i):
        try:
            for _ in range(40):
                calibrate.save(_calib(pack=float(i + 1)), path)
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    seen = 0
    while any(t.is_alive() for t in threads):
        assert calibrate.load(path) is not None
        seen += 1
    for t in threads:
        t.join()
    assert not errors and seen
    assert [p for p in os.listdir(tmp_path) if p != "calibration.json"] == []  # no temporary files left
    with pytest.raises(ValueError, match="invalid calibration"):
        calibrate.save({"version": 1}, path)


# ------------------------------------------------------------------------------------------------------------
# Exact numbers on a small made-up block: width 1000 (1 head of 1000), FFN 4000, one layer, 1000 video tokens,
# Wan's 512 text tokens. Per batch item: self_proj 8 GFLOP, cross_proj 4 + 2.048, ffn 16, self_attn 4,
# cross_attn 2.048. With rates proportional to the token count (1 GFLOP/s at 512 tokens, 4 at 2048), log-log
# interpolation gives 1000/512 = 1.953125 GFLOP/s at 1000 tokens, so self-attention takes 2.048 s, like the
# cross-attention at 512 tokens; GEMMs at 1 GFLOP/s for the 1000-wide projections and 2 for the 4000-wide FFN.
def _small_spec(key="wan22-5b"):
    import dataclasses
    return dataclasses.replace(plan.MODELS["wan22-5b"], key=key, heads=1, head_dim=1000, ffn=4000, layers=1)


def _small_calib(subquad=True):
    att = {"pack": [{"tokens": 512, "gflops": 1.0}, {"tokens": 2048, "gflops": 4.0}]}
    if subquad:
        att["subquad"] = [{"tokens": 512, "gflops": 0.5}, {"tokens": 2048, "gflops": 2.0}]
    return {"version": 1, "device": "test device", "dtype": "fp32", "date": "2026-12-01 12:00 UTC",
            "attention": att, "gemm": [{"m": 512, "k": 1000, "n": 1000, "gflops": 1.0},
                                       {"m": 512, "k": 1000, "n": 4000, "gflops": 2.0}]}


def test_small_block_flops_and_default_text_tokens():
    """The FLOP formula per part, and the text length each model's cross-attention sees: Wan's T5 512 tokens,
    LTX-2.3's 1024, 512 for a model without its own entry; an explicit text length wins."""
    fl = estimate.layer_flops(_small_spec(), 1000)
    assert fl == {"self_proj": 8e9, "cross_proj": 4e9 + 2.048e9, "ffn": 16e9, "self_attn": 4e9,
                  "cross_attn": 2.048e9}
    assert estimate.TEXT_TOKENS == {"wan22-5b": 512, "wan-14b": 512, "ltx23-22b": 1024, "z-image-turbo": 0}
    assert estimate.layer_flops(_small_spec("ltx23-22b"), 1000)["cross_attn"] == 4 * 1000 * 1024 * 1000
    assert estimate.layer_flops(_small_spec("wan-14b"), 1000)["cross_attn"] == 4 * 1000 * 512 * 1000
    assert estimate.layer_flops(_small_spec("other"), 1000)["cross_attn"] == 4 * 1000 * 512 * 1000
    assert estimate.layer_flops(_small_spec(), 1000, text=100)["cross_proj"] == 4e9 + 4 * 100 * 1000 ** 2


def test_step_time_exact_seconds_on_a_small_block():
    """Self-attention at the rate interpolated at N, cross-attention at the rate of the text length, the
    projections at the GEMM rate of the width and the FFN's up and down projections at that of the FFN width
    (the only FFN-sized shape measured: the down projection's own transposed one); two batch items by default (a
    CFG step), every layer by default."""
    t = estimate.step_time(_small_spec(), 1000, _small_calib(), "pack")
    assert t["attention"] == pytest.approx(2 * (2.048 + 2.048), rel=1e-12)
    assert t["gemm"] == pytest.approx(2 * ((8 + 6.048) / 1.0 + 16 / 2.0), rel=1e-12)
    assert t["total"] == pytest.approx(8.192 + 44.096 + t["elementwise"], rel=1e-12)
    one = estimate.step_time(_small_spec(), 1000, _small_calib(), "pack", batch=1)
    assert one["total"] == pytest.approx(t["total"] / 2, rel=1e-12)
    deep = dataclasses.replace(_small_spec(), layers=4)
    blocks = estimate.step_time(deep, 1000, _small_calib(), "pack", blocks=3)
    assert blocks["total"] == pytest.approx(3 * t["total"], rel=1e-12)
    assert blocks["block"] == pytest.approx(t["total"], rel=1e-12) == t["block"]
    assert estimate.step_time(deep, 1000, _small_calib(), "pack")["total"] == pytest.approx(4 * t["total"], rel=1e-12)
    sq = estimate.step_time(_small_spec(), 1000, _small_calib(), "subquad")
    assert sq["attention"] == pytest.approx(16.384, rel=1e-12) and sq["gemm"] == pytest.approx(44.096, rel=1e-12)
    assert sq["elementwise"] == t["elementwise"]
    # a short video: the cross-attention runs at the rate of N tokens, not of the longer text
    short = estimate.step_time(_small_spec(), 256, _small_calib(), "pack", batch=1)
    assert short["attention"] == pytest.approx((4 * 256 ** 2 * 1000 + 4 * 256 * 512 * 1000) / 1e9, rel=1e-12)
    # LTX-2.3: its 1024 text tokens run at the rate of 1024 tokens (2 GFLOP/s here)
    ltx = estimate.step_time(_small_spec("ltx23-22b"), 2048, _small_calib(), "pack", batch=1)
    assert ltx["attention"] == pytest.approx((4 * 2048 ** 2 * 1000) / 4e9 + (4 * 2048 * 1024 * 1000) / 2e9,
                                             rel=1e-12)
    # a model without a text entry: 512 text tokens, at the rate of 512
    other = estimate.step_time(_small_spec("other"), 2048, _small_calib(), "pack", batch=1)
    assert other["attention"] == pytest.approx((4 * 2048 ** 2 * 1000) / 4e9 + (4 * 2048 * 512 * 1000) / 1e9,
                                               rel=1e-12)


def test_gemm_rate_is_the_nearest_shape_on_a_log_scale():
    """Each linear layer takes the rate of the measured GEMM with the nearest output width (by ratio, either
    side); an entry without an output width matches any."""
    calib = {"gemm": [{"n": 1000, "gflops": 1.0}, {"n": 4000, "gflops": 2.0}]}
    assert estimate._gemm_rate(calib, 1000) == 1.0 and estimate._gemm_rate(calib, 4000) == 2.0
    assert estimate._gemm_rate(calib, 1900) == 1.0 and estimate._gemm_rate(calib, 2100) == 2.0  # sqrt = 2000
    assert estimate._gemm_rate(calib, 500) == 1.0 and estimate._gemm_rate(calib, 9000) == 2.0
    assert estimate._gemm_rate({"gemm": [{"n": 1000, "gflops": 1.0}, {"gflops": 3.0}]}, 7) == 3.0


def test_interpolation_is_flat_outside_and_exact_at_the_ends():
    rows = [{"tokens": 1000, "gflops": 2.0}, {"tokens": 4000, "gflops": 8.0}, {"tokens": 16000, "gflops": 4.0}]
    assert estimate._interp(rows, 1) == 2.0 and estimate._interp(rows, 1000) == 2.0
    assert estimate._interp(rows, 16000) == 4.0 and estimate._interp(rows, 10 ** 9) == 4.0
    assert estimate._interp(rows, 2000) == pytest.approx(4.0, rel=1e-12)
    assert estimate._interp(rows, 8000) == pytest.approx(8.0 / 2 ** 0.5, rel=1e-12)
    assert estimate._interp([{"tokens": 1000, "gflops": 5.0}], 3000) == 5.0


def test_run_time_scales_each_stage_and_sums_what_is_calibrated():
    """Each stage's size is the requested size times its scale (at least 1 pixel), its tokens come from the
    given tokens function, its batch is the stage's CFG batch times the requested batch; a method without
    rates has no total."""
    seen = []

    def tokens(spec, w, h, f):
        seen.append((w, h, f))
        return 1000

    spec = _small_spec("ltx23-22b")
    rt = estimate.run_time(spec, 1921, 1089, 9, _small_calib(subquad=False), tokens, batch=3)
    assert seen == [(960, 544, 9), (1921, 1089, 9)]
    s1, s2 = rt["stages"]
    assert (s1["width"], s1["height"], s1["tokens"], s1["steps"]) == (960, 544, 1000, 20)
    assert (s2["width"], s2["height"], s2["steps"]) == (1921, 1089, 3)
    one = estimate.step_time(spec, 1000, _small_calib(), "pack", batch=1)["total"]
    assert s1["per_step"]["pack"]["total"] == pytest.approx(6 * one, rel=1e-12)   # CFG 2 x batch 3
    assert s2["per_step"]["pack"]["total"] == pytest.approx(3 * one, rel=1e-12)   # no CFG, batch 3
    assert s1["per_step"]["subquad"] is None and rt["totals"]["subquad"] is None
    assert rt["totals"]["pack"] == pytest.approx((20 * 6 + 3 * 3) * one, rel=1e-12)
    rt = estimate.run_time(spec, 1, 1, 1, _small_calib(), tokens, steps=[5, 7])
    assert seen[-2:] == [(1, 1, 1), (1, 1, 1)]
    assert [s["steps"] for s in rt["stages"]] == [5, 7]
    assert rt["totals"]["subquad"] == pytest.approx(
        5 * rt["stages"][0]["per_step"]["subquad"]["total"] + 7 * rt["stages"][1]["per_step"]["subquad"]["total"])
    with pytest.raises(ValueError) as e:
        estimate.run_time(spec, 64, 64, 1, _small_calib(), tokens, steps=[20, 3, 1])
    assert str(e.value) == ("--steps: ltx23-22b runs 2 stage(s) (stage 1 (half size), stage 2 (full size)); "
                            "give 2 comma-separated step count(s), got 3")
    with pytest.raises(ValueError) as e:
        estimate.run_time(_small_spec(), 64, 64, 1, _small_calib(), tokens, steps=[20, 3])
    assert str(e.value) == ("--steps: wan22-5b runs 1 stage(s) (sampling); give 1 comma-separated step count(s), "
                            "got 2")


@pytest.mark.parametrize("seconds, text", [
    (0.04, "0.0 s"), (1.25, "1.2 s"), (119.94, "119.9 s"),          # seconds under 2 minutes
    (120, "2.0 min"), (1045.76, "17.4 min"), (7199, "120.0 min"),  # minutes under 2 hours
    (7200, "2.00 h"), (9000, "2.50 h"), (3_600_000 * 1.5, "1,500.00 h"),
])
def test_durations_switch_units_at_two_minutes_and_two_hours(seconds, text):
    assert estimate._dur(seconds) == text


def test_report_lines_exactly():
    """The whole time section on the small block: header naming the calibration, one line per stage (size,
    tokens, steps, batch, CFG), per method the step time split into attention and the rest and the stage's time,
    then the run's total per method; a method the calibration lacks says how to get it and has no total."""
    calib = {**_small_calib(), "elementwise": [{"rows": 4096, "width": 1000, "gbps": 0.2}]}
    text = estimate.report(_small_spec(), 832, 480, 41, calib, "/x/c.json", tokens=lambda *a: 1000)
    # elementwise: 2 x (47 x 1,000 x 1,000 + 2 x 1,000 x 4,000 + 6 x 512 x 1,000) x 4 bytes = 0.464576 GB at
    # 0.2 GB/s = 2.32288 s; the step 8.192 + 44.096 + 2.32288 = 54.61 s
    assert text.split("\n") == [
        "  time (calibration of test device, fp32, 2026-12-01 12:00 UTC; all 1 block a step):",
        "    counted: GEMMs at the rates measured nearest each layer's shape, attention, and elementwise passes "
        "(norms, modulation, RoPE, residual adds, layout copies, GELU) at 0.2 GB/s (measured)",
        "    sampling: 832x480, 1,000 tokens, 20 steps, batch 2 (CFG)",
        "      this pack (auto)         54.6 s a step, 54.6 s a block (attention 8.2 s, GEMMs 44.1 s, elementwise "
        "2.3 s); 18.2 min for the stage",
        "      ComfyUI sub-quadratic    62.8 s a step, 62.8 s a block (attention 16.4 s, GEMMs 44.1 s, elementwise "
        "2.3 s); 20.9 min for the stage",
        "    whole run, this pack (auto)         18.2 min",
        "    whole run, ComfyUI sub-quadratic    20.9 min",
    ]
    text = estimate.report(_small_spec("ltx23-22b"), 1920, 1088, 9, _small_calib(subquad=False), steps=[10, 2],
                           batch=2, tokens=lambda *a: 1000)
    lines = text.split("\n")
    assert lines[1].endswith(" at 0.04 GB/s (assumed: this calibration has no elementwise rate; python -m "
                             "attention_core.calibrate measures one)")  # 1 GFLOP/s / 25
    assert lines[2] == "    stage 1 (half size): 960x544, 1,000 tokens, 10 steps, batch 4 (CFG)"
    assert lines[3].startswith("      this pack (auto)         ")
    assert lines[4] == ("      ComfyUI sub-quadratic    not calibrated (ComfyUI was not found by "
                        "python -m attention_core.calibrate)")
    assert lines[5] == "    stage 2 (full size): 1920x1088, 1,000 tokens, 2 steps, batch 2"
    assert lines[7:] == [lines[4], lines[-1]] and lines[-1].startswith("    whole run, this pack (auto)         ")
    assert len(lines) == 9


def test_report_without_a_calibration_says_how_to_make_one():
    spec = plan.MODELS["wan22-5b"]
    assert estimate.report(spec, 832, 480, 41, None, "/x/c.json") == (
        "  time per step: no calibration of this device at /x/c.json, so no estimate; "
        "run `python -m attention_core.calibrate --out /x/c.json` (about a minute) and ask again")
    assert estimate.report(spec, 832, 480, 41, None) == (
        "  time per step: no calibration of this device, so no estimate; "
        "run `python -m attention_core.calibrate` (about a minute) and ask again")


def test_wan_14b_runs_wans_default_schedule():
    """Wan 14B has no bundled workflow: Wan's own default, 20 CFG steps at the requested size, like the 5B's."""
    assert estimate.STAGES["wan-14b"] == (estimate.Stage("sampling", 20, 2, 1.0),) == estimate.STAGES["wan22-5b"]
    rt = estimate.run_time(plan.MODELS["wan-14b"], 1280, 720, 81, _calib(), plan.tokens)
    (s,) = rt["stages"]
    assert (s["width"], s["height"], s["steps"], s["tokens"]) == (1280, 720, 20, 21 * 45 * 80)
    assert rt["totals"]["pack"] == pytest.approx(20 * s["per_step"]["pack"]["total"])


# ------------------------------------------------------------------------------------------------------------
# Issue 24.4: estimates a user can check. Elementwise passes are counted, each linear layer takes the GEMM rate
# measured at its own shape and row count, and a step can be timed for fewer blocks (a one-block demo).
def test_elementwise_passes_of_a_block_hand_count():
    """Elements read plus written by one Wan block for one batch item (N 1,000, C 1,000, F 4,000, L 512): norms
    (3 LayerNorms, 3 RMSNorms: 12 NC; the text keys' RMSNorm 2 LC), modulation and residuals (2 x 2 + 3 x 3 =
    13 NC), RoPE on q and k (10 NC), layout copies (self q, k, v, out 8 NC; cross q, out 4 NC; text k, v 4 LC),
    the GELU (2 NF)."""
    ew = estimate.layer_elementwise(_small_spec(), 1000)
    assert ew == {"norms": 12e6 + 2 * 512e3, "modulation": 13e6, "rope": 10e6, "layout": 12e6 + 4 * 512e3,
                  "activation": 8e6}
    assert estimate.layer_elementwise(_small_spec(), 1000, text=0)["norms"] == 12e6
    # Wan 2.2 5B at 4,290 tokens: 47 NC + 6 LC + 2 NF elements, about 0.69 GB of fp32 traffic per item and block
    wan = estimate.layer_elementwise(plan.MODELS["wan22-5b"], 4290)
    assert sum(wan.values()) == 47 * 4290 * 3072 + 6 * 512 * 3072 + 2 * 4290 * 14336


def test_elementwise_time_is_bytes_over_the_measured_bandwidth():
    """Measured: the elements of every block and batch item times the calibration dtype's bytes over the median
    elementwise rate (GB/s); it is part of `rest` and `total`. Half-precision calibrations count 2 bytes."""
    calib = {**_small_calib(), "elementwise": [{"gbps": 0.5}, {"gbps": 0.1}, {"gbps": 0.2}]}
    elements = sum(estimate.layer_elementwise(_small_spec(), 1000).values())
    t = estimate.step_time(_small_spec(), 1000, calib, "pack", batch=3)
    assert t["elementwise"] == pytest.approx(3 * elements * 4 / 0.2e9, rel=1e-12)
    assert t["rest"] == pytest.approx(t["gemm"] + t["elementwise"], rel=1e-12)
    assert t["total"] == pytest.approx(t["attention"] + t["gemm"] + t["elementwise"], rel=1e-12)
    for dtype in ("fp16", "bf16"):
        half = estimate.step_time(_small_spec(), 1000, {**calib, "dtype": dtype}, "pack", batch=3)
        assert half["elementwise"] == pytest.approx(t["elementwise"] / 2, rel=1e-12)
    assert estimate.elementwise_rate(calib, 1000) == (0.2, True)


def test_a_calibration_without_an_elementwise_rate_assumes_one_from_its_gemm_rate():
    """Files made before the elementwise rate was measured stay usable: the width x width GEMM rate over
    DEFAULT_FLOPS_PER_BYTE (25) FLOPs a byte, said in the report as assumed."""
    assert estimate.DEFAULT_FLOPS_PER_BYTE == 25.0
    calib = _small_calib()  # width x width at 1 GFLOP/s
    assert estimate.elementwise_rate(calib, 1000) == (1.0 / 25, False)
    elements = sum(estimate.layer_elementwise(_small_spec(), 1000).values())
    t = estimate.step_time(_small_spec(), 1000, calib, "pack", batch=1)
    assert t["elementwise"] == pytest.approx(elements * 4 / (1e9 / 25), rel=1e-12)
    text = estimate.report(_small_spec(), 832, 480, 41, calib, tokens=lambda *a: 1000)
    assert "at 0.04 GB/s (assumed: this calibration has no elementwise rate; python -m attention_core.calibrate " \
           "measures one)" in text


def _shapes_calib():
    """GEMMs at 512 and 4,096 rows of the width x width, up and down shapes (width 1,000, FFN 4,000), each with
    its own rate: the row count and the shape decide which applies."""
    rates = {(1000, 1000): (8.0, 1.0), (1000, 4000): (16.0, 4.0), (4000, 1000): (32.0, 2.0)}
    return {**_small_calib(), "gemm": [{"m": m, "k": k, "n": n, "gflops": rate[i]} for (k, n), rate in rates.items()
                                       for i, m in enumerate((512, 4096))]}


def test_each_linear_layer_takes_the_rate_measured_at_its_shape_and_rows():
    """The rate of the nearest (k, n) shape, log-log interpolated over the measured rows (flat outside): 512 rows
    gave a rate above what the model's layers reach at thousands of rows (issue 24: 274 GFLOP/s measured at
    512 x 3072 x 3072)."""
    calib = _shapes_calib()
    assert estimate._gemm_rate(calib, 1000, 512, 1000) == 8.0 and estimate._gemm_rate(calib, 1000, 4096, 1000) == 1.0
    assert estimate._gemm_rate(calib, 1000, 8580, 1000) == 1.0 and estimate._gemm_rate(calib, 1000, 100, 1000) == 8.0
    # 1,024 rows: a third of the way from 512 to 4,096 on a log scale
    assert estimate._gemm_rate(calib, 1000, 1024, 1000) == pytest.approx(8.0 ** (2 / 3) * 1.0 ** (1 / 3), rel=1e-12)
    assert estimate._gemm_rate(calib, 4000, 4096, 1000) == 4.0   # the FFN's up projection
    assert estimate._gemm_rate(calib, 1000, 4096, 4000) == 2.0   # and its down projection, measured on its own
    # without the down projection's own shape (calibrations before issue 24), the transposed (up) shape serves
    old = {**calib, "gemm": [r for r in calib["gemm"] if r["k"] != 4000]}
    assert estimate._gemm_rate(old, 1000, 4096, 4000) == 4.0
    # without rows (or an entry without m): the median of the nearest shape's entries; without k, every entry
    # of that output width is as near (8, 1, 32 and 2 GFLOP/s)
    assert estimate._gemm_rate(calib, 1000, None, 1000) == 4.5 and estimate._gemm_rate(calib, 1000) == 5.0


def test_step_time_runs_the_linear_layers_at_the_batchs_rows():
    """A step's linear layers see N x batch rows (the CFG pair is one batch), the text's keys and values L x
    batch: at 2 x 1,000 rows and 2 x 512 the rates interpolate between the 512- and 4,096-row measurements."""
    calib, spec = _shapes_calib(), _small_spec()
    t = estimate.step_time(spec, 1000, calib, "pack", batch=2)
    r = lambda n, rows, k: estimate._gemm_rate(calib, n, rows, k) * 1e9  # noqa: E731
    want = 2 * (6 * 2 * 1000 * 1000 * 1000 / r(1000, 2000, 1000) + 2 * 2 * 512 * 1000 * 1000 / r(1000, 1024, 1000)
                + 2 * 1000 * 1000 * 4000 / r(4000, 2000, 1000) + 2 * 1000 * 4000 * 1000 / r(1000, 2000, 4000))
    assert t["gemm"] == pytest.approx(want, rel=1e-12)
    assert r(1000, 2000, 1000) < 8e9 and r(1000, 1024, 1000) > r(1000, 2000, 1000)
    flops = sum(c * 2 * m * k * n for _, m, k, n, c in estimate.layer_gemms(spec, 1000))
    fl = estimate.layer_flops(spec, 1000)
    assert flops == fl["self_proj"] + fl["cross_proj"] + fl["ffn"]


def test_a_step_for_fewer_blocks_and_the_time_per_block():
    """blocks k: every time for k blocks (a one-block demo's step); "block" is the step over its blocks. Out of
    range (0, more than the model has, not a whole number): one ValueError naming the model's depth."""
    spec = plan.MODELS["wan22-5b"]
    full = estimate.step_time(spec, 2340, _calib(), "pack")
    one = estimate.step_time(spec, 2340, _calib(), "pack", blocks=1)
    for key in ("attention", "gemm", "elementwise", "total"):
        assert one[key] == pytest.approx(full[key] / 30, rel=1e-12)
    assert one["block"] == pytest.approx(one["total"], rel=1e-12) and full["block"] == pytest.approx(one["total"])
    rt = estimate.run_time(spec, 832, 480, 21, _calib(), plan.tokens, blocks=2)
    assert rt["blocks"] == 2 and rt["stages"][0]["per_step"]["pack"]["total"] == pytest.approx(2 * one["total"])
    for bad in (0, -1, 31, 1.0, True, "1"):
        with pytest.raises(ValueError) as e:
            estimate.step_time(spec, 2340, _calib(), "pack", blocks=bad)
        assert str(e.value) == f"blocks: Wan 2.2 TI2V 5B has 30 blocks; give a whole number from 1 to 30, got {bad!r}"
    text = estimate.report(spec, 832, 480, 21, _calib(), tokens=plan.tokens, blocks=1)
    assert "; 1 of its 30 blocks a step):" in text.split("\n")[0]
    line = next(ln for ln in text.split("\n") if ln.strip().startswith("this pack"))
    assert f"{estimate._dur(one['total'])} a step, {estimate._dur(one['total'])} a block (attention" in line

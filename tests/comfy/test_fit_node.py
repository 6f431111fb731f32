"""Attention Fit (nodes/fit.py) in the real ComfyUI: the same numbers as python -m attention_core.plan."""
import importlib

import pytest

from comfy_harness import PACK_NAME, load_pack

pytestmark = pytest.mark.comfy_inprocess


def fit_node():
    load_pack()
    return importlib.import_module(PACK_NAME + ".nodes.fit").AttentionFit


def test_schema_offers_the_four_models():
    schema = fit_node().define_schema()
    assert schema.node_id == "TiledAttentionFit"
    combo = next(i for i in schema.inputs if i.id == "model")
    assert set(combo.options) == {"wan22-5b", "wan-14b", "ltx23-22b", "z-image-turbo"}


def test_same_report_as_the_plan_module():
    from attention_core.cli import plan
    import comfy.model_management as mm
    out = fit_node().execute(model="wan22-5b", width=1280, height=720, frames=121, dtype="fp16", free_gb=32.0)
    text = out.result[0]
    device = str(mm.get_torch_device())
    est = plan.estimate("wan22-5b", 1280, 720, 121, 32 << 30, 2, cpu=device == "cpu", dtype="fp16")
    assert text == plan.report(est) + "\n\n" + plan.time_report(est, device=device)
    assert "28,520 video tokens" in text and out.ui["text"] == [text]
    assert "K/V copies" in text  # ComfyUI hands q, k, v as [B, N, H*D]: the engine's copies are counted


def test_time_per_step_from_the_calibration(tmp_path, monkeypatch):
    """With this device's calibration file the report gives seconds per step for the pack and sub-quadratic,
    with the calibration's device and date; without one it says so and gives the command."""
    node = fit_node()
    calibrate = importlib.import_module(PACK_NAME + ".attention_core.device.calibration")  # the copy the node imported
    path = str(tmp_path / "cal.json")
    monkeypatch.setattr(calibrate, "calibration_path", lambda device="cpu", dtype="fp32": path)
    text = node.execute(model="wan22-5b", width=832, height=480, frames=41, dtype="fp32", free_gb=8.0).result[0]
    assert "no calibration" in text and "python -m attention_core.calibrate --out " + path in text
    rates = [{"tokens": 1024, "gflops": 50.0}, {"tokens": 4096, "gflops": 60.0}]
    calibrate.save({"version": 1, "device": "Test GPU (gfx906)", "dtype": "fp32", "date": "2026-12-01 12:00 UTC",
                    "attention": {"pack": rates, "subquad": rates}, "gemm": [{"n": 3072, "gflops": 100.0}]}, path)
    text = node.execute(model="wan22-5b", width=832, height=480, frames=41, dtype="fp32", free_gb=8.0).result[0]
    assert "Test GPU (gfx906)" in text and "2026-12-01 12:00 UTC" in text and "4,290 tokens, 20 steps" in text
    assert "this pack (auto)" in text and "ComfyUI sub-quadratic" in text and "whole run" in text


def test_free_memory_defaults_to_comfyuis_device():
    out = fit_node().execute(model="ltx23-22b", width=1920, height=1088, frames=129, dtype="bf16", free_gb=0.0)
    assert "34,680 video tokens" in out.result[0] and "recommended" in out.result[0]


def test_a_size_whose_first_stage_has_no_tokens_is_refused():
    """Issue 22.9: LTX-2.3 at 32x32 has a token at full size but none in its half-size first stage: the node
    refuses it with the smallest size that works (plan.estimate's error), and 64x64 runs."""
    node = fit_node()
    with pytest.raises(ValueError, match=r"LTX-2.3 22B \(video stream\) needs width >= 64, height >= 64 and frames "
                                         r">= 1 \(its VAE compresses 32x32 pixels into one latent and its stage 1 "
                                         r"\(half size\) samples at 0.5 of the size"):
        node.execute(model="ltx23-22b", width=32, height=32, frames=1, dtype="fp16", free_gb=8.0)
    assert "4 video tokens" in node.execute(model="ltx23-22b", width=64, height=64, frames=1, dtype="fp16",
                                            free_gb=8.0).result[0]


def test_blocks_times_fewer_blocks_and_defaults_to_all(tmp_path, monkeypatch):
    """Issue 24.4: an optional `blocks` input (0, the default: all of the model's blocks; saved workflows without
    it still run) times a step of that many blocks, as `plan --blocks` does; more blocks than the model has, or a
    negative count, is one error naming the node and the model's depth."""
    node = fit_node()
    schema = node.define_schema()
    blocks = next(i for i in schema.inputs if i.id == "blocks")
    assert blocks.optional and blocks.default == 0 and blocks.min == 0 and blocks.max == 48 and blocks.tooltip
    calibration = importlib.import_module(PACK_NAME + ".attention_core.device.calibration")
    path = str(tmp_path / "cal.json")
    monkeypatch.setattr(calibration, "calibration_path", lambda device="cpu", dtype="fp32": path)
    rates = [{"tokens": 1024, "gflops": 50.0}, {"tokens": 4096, "gflops": 60.0}]
    calibration.save({"version": 1, "device": "Test GPU (gfx906)", "dtype": "fp32", "date": "2026-12-01 12:00 UTC",
                      "attention": {"pack": rates, "subquad": rates}, "gemm": [{"n": 3072, "gflops": 100.0}]}, path)
    plan = importlib.import_module(PACK_NAME + ".attention_core.plan")  # the copy the node imported
    import comfy.model_management as mm
    device = str(mm.get_torch_device())
    args = dict(model="wan22-5b", width=832, height=480, frames=21, dtype="fp32", free_gb=8.0)
    est = plan.estimate("wan22-5b", 832, 480, 21, 8 << 30, 4, cpu=device == "cpu", dtype="fp32")
    one = node.execute(**args, blocks=1).result[0]
    assert one == plan.report(est) + "\n\n" + plan.time_report(est, device=device, blocks=1)
    assert "1 of its 30 blocks a step" in one and " a block (attention " in one
    assert node.execute(**args).result[0] == node.execute(**args, blocks=0).result[0] == node.execute(
        **args, blocks=30).result[0]
    assert "all 30 blocks a step" in node.execute(**args).result[0]
    for bad in (31, -1):
        with pytest.raises(ValueError) as e:
            node.execute(**args, blocks=bad)
        assert str(e.value) == (f"Attention Fit: Wan 2.2 TI2V 5B has 30 blocks; set blocks from 1 to 30, or 0 for "
                                f"all of them, got {bad}")

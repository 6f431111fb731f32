"""Attention Fit (nodes/fit.py) in the real ComfyUI: the same numbers as python -m attention_core.plan."""
import importlib

import pytest

from comfy_harness import PACK_NAME, load_pack

pytestmark = pytest.mark.comfy_inprocess


def fit_node():
    load_pack()
    return importlib.import_module(PACK_NAME + ".nodes.fit").AttentionFit


def test_schema_offers_the_three_models():
    schema = fit_node().define_schema()
    assert schema.node_id == "TiledAttentionFit"
    combo = next(i for i in schema.inputs if i.id == "model")
    assert set(combo.options) == {"wan22-5b", "wan-14b", "ltx23-22b"}


def test_same_report_as_the_plan_module():
    from attention_core import plan
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
    calibrate = importlib.import_module(PACK_NAME + ".attention_core.calibration")  # the copy the node imported
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

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
    out = fit_node().execute(model="wan22-5b", width=1280, height=720, frames=121, dtype="fp16", free_gb=32.0)
    text = out.result[0]
    assert text == plan.report(plan.estimate("wan22-5b", 1280, 720, 121, 32 << 30, 2))
    assert "28,520 video tokens" in text and out.ui["text"] == [text]


def test_free_memory_defaults_to_comfyuis_device():
    out = fit_node().execute(model="ltx23-22b", width=1920, height=1088, frames=129, dtype="bf16", free_gb=0.0)
    assert "34,680 video tokens" in out.result[0] and "recommended" in out.result[0]

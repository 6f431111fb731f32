"""Issue 38.9: in ComfyUI after 0.33.0 a layer's own attention chosen by its checkpoint (`preferred_attention`,
ComfyAttention.function: comfy-kitchen's int8 today) is called by wrap_attn instead of the wrapped function, so the
process-wide mode's cell route (nodes/comfy_global_route.py) never sees it; nodes/comfy_preferred_route.py routes
it. Tested in the real ComfyUI 0.33.0 with the pack as ComfyUI loads it, on a stand-in of the newer attention module
(tools/fixtures/comfy_preferred_attention_standin.py, following that file's wrap_attn) put where the pack looks for
it (comfy.ldm.modules.attention.ComfyAttention): tensors and single-owner containers, the engine's result against
float64 attention, min_tokens passing calls on untouched, a per-model override still winning, and nothing left
after the mode is switched off."""
import sys

import pytest
import torch

from comfy_harness import PACK_NAME

pytestmark = pytest.mark.comfy_inprocess


def mod(name):
    return sys.modules[f"{PACK_NAME}.{name}"]


@pytest.fixture
def standin(pack, monkeypatch):
    """The stand-in module, its ComfyAttention where the pack looks for ComfyUI's."""
    import comfy.ldm.modules.attention as attention

    import tools.fixtures.comfy_preferred_attention_standin as s
    monkeypatch.setattr(attention, "ComfyAttention", s.ComfyAttention, raising=False)
    return s


@pytest.fixture
def ew(pack, standin):
    everywhere, patch = mod("nodes.everywhere"), mod("attention_core.patch")
    assert everywhere.state()["mode"] == "off"
    patch.reset_stats()
    yield everywhere
    everywhere.set_mode("off")
    assert "function" not in standin.ComfyAttention.__dict__  # the class as it was
    assert not mod("nodes.comfy_preferred_route").routed()


def _engine_calls(monkeypatch):
    calls = [0]
    m = mod("nodes.comfy_adapter")
    real = m.scaled_dot_product_attention

    def counted(*a, **k):
        calls[0] += 1
        return real(*a, **k)
    monkeypatch.setattr(m, "scaled_dot_product_attention", counted)
    return calls


def _inputs(n=40, heads=4, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, n, heads * d, generator=g) * 3 for _ in range(3))


def _exact(q, k, v, heads):
    b, n, c = q.shape
    q, k, v = (t.double().view(b, t.shape[1], heads, c // heads).transpose(1, 2) for t in (q, k, v))
    return torch._C._nn.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c)


def _err(a, b):
    return float((a.double() - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("containers", [False, True], ids=["tensors", "containers"])
def test_a_layers_preferred_attention_runs_through_the_engine_in_the_process_wide_mode(ew, standin, monkeypatch,
                                                                                       containers):
    engine = _engine_calls(monkeypatch)
    q, k, v = _inputs()
    layer = standin.Layer(4)
    int8 = layer(q, k, v, containers=containers)  # mode off: the layer's own (int8) attention
    exact = _exact(q, k, v, 4)
    int8_err = _err(int8, exact)
    assert int8_err > 1e-3 and engine[0] == 0  # the stand-in is visibly not exact
    ew.set_mode("chunked", 0)
    on = layer(q, k, v, containers=containers)
    assert engine[0] == 1, "the layer's preferred attention did not reach the engine"
    assert _err(on, exact) < 1e-5 < int8_err
    s = mod("attention_core.patch").stats()["comfy_attention"]
    assert s["routed"] == 1 and s["total"] == 1, s
    # a layer made while the mode is on, and one whose checkpoint names no method (ComfyUI's wrapped function)
    late = standin.Layer(4)
    assert late.comfy_attention.__dict__["function"] is standin.attention_int8
    assert _err(late(q, k, v, containers=containers), exact) < 1e-5 and engine[0] == 2
    plain = standin.Layer(4, method=None)
    assert plain.comfy_attention.function is None
    ew.set_mode("off")
    assert layer.comfy_attention.function is standin.attention_int8  # each layer's own, untouched
    assert torch.equal(layer(q, k, v, containers=containers), int8) and engine[0] == 2


def test_passed_calls_keep_their_containers_and_an_override_still_wins(ew, standin, monkeypatch):
    """min_tokens above the call's tokens: the layer's own function gets the containers untouched (it takes them
    itself: its int8 container path); a per-model override in transformer_options (Patch Attention's place) still
    comes first, as in ComfyUI's wrapper."""
    engine = _engine_calls(monkeypatch)
    q, k, v = _inputs()
    layer = standin.Layer(4)
    want = layer(q, k, v, containers=True)
    ew.set_mode("chunked", 1000)
    boxes = [standin.AttentionTensorContainer(t) for t in (q, k, v)]
    got = standin.attention_basic(*boxes, 4, preferred_attention=layer.comfy_attention)
    assert torch.equal(got, want) and engine[0] == 0
    for b in boxes:
        with pytest.raises(RuntimeError):  # consumed by the layer's own container path, once
            b.peek()
    assert mod("attention_core.patch").stats()["comfy_attention"]["passed"] == 1
    seen = []

    def override(func, *args, **kwargs):
        seen.append(func)
        return func(*args, **kwargs)
    out = layer(q, k, v, transformer_options={"optimized_attention_override": override})
    assert seen == [standin.attention_basic.__wrapped__] and engine[0] == 0
    assert _err(out, _exact(q, k, v, 4)) < 1e-5


def test_nothing_to_route_in_a_comfyui_without_per_layer_attention(pack, monkeypatch):
    """ComfyUI 0.33.0 and older have no ComfyAttention: route() reports False and changes nothing."""
    import comfy.ldm.modules.attention as attention
    monkeypatch.delattr(attention, "ComfyAttention", raising=False)
    r = mod("nodes.comfy_preferred_route")
    assert r.route() is False and r.unroute() is False and r.routed() is False


def test_a_call_with_integer_tensors_stays_with_the_layers_function(ew, standin, monkeypatch):
    """Only floating-point queries go to the engine: integer q/k/v (no attention the engine computes) reach the
    layer's own function, counted as passed, whatever it then does with them."""
    engine = _engine_calls(monkeypatch)
    q, k, v = (t.round().to(torch.int32) for t in _inputs())
    layer = standin.Layer(4)
    ew.set_mode("chunked", 0)
    try:
        layer(q, k, v)
    except Exception:  # noqa: BLE001 - the layer's function may refuse integers; the route is what is tested
        pass
    assert engine[0] == 0, "integer tensors were sent to the engine"
    s = mod("attention_core.patch").stats()["comfy_attention"]
    assert s["passed"] == 1 and s["routed"] == 0, s

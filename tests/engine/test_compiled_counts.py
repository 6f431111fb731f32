"""Calls counted where the engine runs (issue 30, item 8): tiled_attention::fwd's implementation counts the call
under its count_as key (attention_core/kernel/counts.py), so the global patch's stats() are the same with and
without torch.compile (real compiles: backends eager, aot_eager and inductor, fullgraph=True), once per attention
call (a head split over devices runs the op once per group), never twice in eager code."""
import pytest
import torch
import torch.nn.functional as F

import attention_core
import attention_core.patch as patch_mod
from attention_core import multidevice
from attention_core.kernel import counts

TORCH_SDPA = F.scaled_dot_product_attention


@pytest.fixture(autouse=True)
def _clean():
    import torch._dynamo
    patch_mod.reset_stats()
    torch._dynamo.reset()
    yield
    attention_core.disable()
    patch_mod.reset_stats()
    torch._dynamo.reset()


def _qkv(heads=2, n=8, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, n, 4, generator=g).requires_grad_(grad) for _ in range(3)]


def _graph_breaks():
    from torch._dynamo.utils import counters
    return dict(counters["graph_break"])


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_patch_counts_are_the_same_compiled_and_eager(backend):
    """Three eager calls and three calls of the same function compiled with fullgraph=True: six routed, three of
    them compiled, no graph break, torch's answer (before: the compiled calls were not counted, 3 routed of 3)."""
    from torch._dynamo.utils import counters
    counters.clear()
    q, k, v = _qkv()
    want = TORCH_SDPA(q, k, v)

    def f(a, b, c):  # the op alone: inductor's graph calls it, with no kernel of its own to build (seconds)
        return F.scaled_dot_product_attention(a, b, c)
    attention_core.enable(force=True, tier="chunked")
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    for run in (f, compiled):
        for _ in range(3):
            assert torch.allclose(run(q, k, v), want, atol=1e-5)
    assert _graph_breaks() == {}
    assert patch_mod.stats()[patch_mod.SDPA_PATH] == {"routed": 6, "passed": 0, "deferred": 0, "total": 6,
                                                      "compiled": 3}


def test_training_calls_count_once_each_compiled_and_eager():
    """With gradients (aot_eager traces the backward too): each forward counts once, a backward adds nothing."""
    q, k, v = _qkv(grad=True)

    def f(a, b, c):
        return F.scaled_dot_product_attention(a, b, c).square().sum()
    attention_core.enable(force=True, tier="online")
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    for run in (f, compiled):
        for _ in range(2):
            run(q, k, v).backward()
    assert patch_mod.stats()[patch_mod.SDPA_PATH]["routed"] == 4
    assert patch_mod.stats()[patch_mod.SDPA_PATH]["compiled"] == 2


def test_passed_calls_are_counted_in_eager_code_only():
    """A call the patch passes on is counted by the patch in eager code; inside a compiled graph it is not seen
    (a Python counter read there would be a guard), which stats() says through "compiled" = 0 of the routed."""
    q, k, v = _qkv()
    attention_core.enable(min_tokens=10 ** 6)
    f = lambda a, b, c: F.scaled_dot_product_attention(a, b, c)  # noqa: E731
    f(q, k, v)
    torch.compile(f, backend="eager", fullgraph=True)(q, k, v)
    assert patch_mod.stats()[patch_mod.SDPA_PATH] == {"routed": 0, "passed": 1, "deferred": 0, "total": 1,
                                                      "compiled": 0}


@pytest.mark.parametrize("compiled", [False, True])
def test_a_head_split_counts_one_call(compiled):
    """A head split over two devices runs the op once per group; the call counts once, eager and compiled."""
    q, k, v = _qkv(heads=4)

    def f(a, b, c):
        return multidevice.scaled_dot_product_attention_on_devices(a, b, c, devices=["cpu", "cpu"],
                                                                   count_as=counts.traced_key("test:split"))
    run = torch.compile(f, backend="eager", fullgraph=True) if compiled else f
    for _ in range(3):
        assert torch.allclose(run(q, k, v), TORCH_SDPA(q, k, v), atol=1e-5)
    assert counts.calls("test:split") == (3, 3 if compiled else 0)
    counts.reset("test:")
    assert counts.calls("test:split") == (0, 0) and counts.counted("test:") == {}


def test_count_keys_are_checked():
    """count_as is a str: anything else is refused naming it; the patch's options cannot carry it (the patch counts
    its own calls)."""
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="count_as must be a str"):
        attention_core.scaled_dot_product_attention(q, k, v, count_as=1)
    with pytest.raises(ValueError, match="count_as is the patch's own"):
        attention_core.enable(force=True, count_as="mine")
    attention_core.scaled_dot_product_attention(q, k, v, count_as="")
    assert counts.counted("") == {} or "" not in counts.counted("")
    counts.add("test:x")
    counts.add("test:x")
    assert counts.counted("test:") == {"test:x": (2, 0)} and counts.traced_key("test:x") == "test:x"
    counts.reset("test:")

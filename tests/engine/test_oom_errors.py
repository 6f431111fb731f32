"""Out-of-memory handling (issue 9 item 13): ROCm's messages are retried like CUDA's, the final error keeps the
original as __cause__ and states the free memory found, and a bad memory_budget is a ValueError naming it."""
import pytest
import torch

from attention_core import AttentionMemoryError
from attention_core import scaled_dot_product_attention as sdpa
from attention_core.kernel.oom import is_oom
from attention_core.kernel.tiers import TIERS
from reference import reference

ROCM = ["HIP error: hipErrorOutOfMemory\nHIP kernel errors might be asynchronously reported",
        "HIP out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.98 GiB total capacity)"]


@pytest.mark.parametrize("msg", ROCM + ["CUDA out of memory. Tried to allocate 20 MiB"])
def test_accelerator_oom_messages_are_oom(msg):
    assert is_oom(RuntimeError(msg))


def test_other_errors_are_not_oom():
    assert not is_oom(RuntimeError("HIP error: hipErrorIllegalAddress"))
    assert not is_oom(AttentionMemoryError("x"))


def _failing(monkeypatch, make):
    calls = []

    def wrap(name, fn):
        def run(src, bq, bk, need_stats, **kw):
            calls.append(name)
            err = make(name, len(calls))
            if err is not None:
                raise err
            return fn(src, bq, bk, need_stats, **kw)
        return run
    for name, fn in list(TIERS.items()):
        monkeypatch.setitem(TIERS, name, wrap(name, fn))
    return calls


@pytest.mark.parametrize("msg", ROCM)
def test_rocm_oom_is_retried_smaller(monkeypatch, msg):
    calls = _failing(monkeypatch, lambda name, n: RuntimeError(msg) if n == 1 else None)
    q = torch.randn(1, 4, 32, 8)
    out = sdpa(q, q, q, tier="chunked")
    assert calls[0] == "chunked" and len(calls) >= 2  # failed once, then ran in smaller tiles
    assert (out.double() - reference(q, q, q)).abs().max() < 1e-5


def test_final_error_keeps_the_cause_and_states_free_memory(monkeypatch):
    first = []

    def make(name, n):
        e = torch.OutOfMemoryError(f"CUDA out of memory (injected {n})")
        first.append(e)
        return e
    _failing(monkeypatch, make)
    q = torch.randn(1, 2, 40, 8)
    with pytest.raises(AttentionMemoryError) as info:
        sdpa(q, q, q, memory_budget=1 << 20)
    assert info.value.__cause__ is first[-1]
    msg = str(info.value)
    assert "free memory found" in msg and " MB" in msg.split("free memory found")[1]
    assert "memory_budget" in msg


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), "1GB", -1, 0, True])
def test_bad_memory_budget_is_a_value_error_naming_it(bad):
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="memory_budget"):
        sdpa(q, q, q, memory_budget=bad)
    from attention_core.kernel.ops import attention_forward
    with pytest.raises(ValueError, match="memory_budget"):
        attention_forward(q, q, q, memory_budget=bad)

"""The engine's eager path on one thread while another thread compiles (issue 30, item 12).

torch.compiler.is_compiling() is a process-wide flag on torch 2.14: True on every thread while any thread runs a
torch.compile (and during torch.export). The engine's questions are this thread's: is dynamo tracing this call
(torch.compiler.is_dynamo_compiling()), and, for the multi-device split, does this thread run under a tensor
subclass mode (make_fx / export / fake tensors). Here a real torch.compile is held open on another thread (its
backend waits) while this thread runs forward-mode AD through the engine and a head split over two devices; and a
make_fx trace of the head split records every group's work."""
import contextlib
import logging
import threading

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import attention_core
from attention_core import multidevice
from attention_core.kernel import autograd, tangents

HUNG = 300  # seconds: only a deadlock waits this long


@contextlib.contextmanager
def another_thread_compiling():
    """For the block, a torch.compile in progress on another thread: its backend (run inside the compile) waits
    until the block ends. Yields whether torch.compiler.is_compiling() answers True on this thread meanwhile (on
    torch 2.14 it does: the flag is process-wide)."""
    inside, release, errors = threading.Event(), threading.Event(), []

    def backend(gm, example_inputs):
        inside.set()
        release.wait(HUNG)
        return gm.forward

    def compile_one():
        try:
            torch.compile(lambda x: x * 2 + 1, backend=backend)(torch.randn(3))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            inside.set()
    t = threading.Thread(target=compile_one, daemon=True)
    t.start()
    assert inside.wait(HUNG) and not errors, errors
    try:
        yield torch.compiler.is_compiling()
    finally:
        release.set()
        t.join(HUNG)
    assert not t.is_alive() and not errors, errors


def _math(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v


def _qkv(heads=2, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, n, 4, generator=g, dtype=torch.float64) for _ in range(3)]


def test_forward_mode_ad_keeps_the_tiled_rule_while_another_thread_compiles(monkeypatch):
    """Dual tensors through the engine while another thread compiles: the tiled forward-mode rule (O(N) memory), not
    the O(Lq * Lk) plain ops meant for a dynamo trace under forward mode (before, on torch 2.14: plain_attention
    ran); the tangent is math's; forward_mode_active on plain tensors in an open dual level stays False."""
    plain = []
    real = autograd.plain_attention
    monkeypatch.setattr(autograd, "plain_attention", lambda *a: plain.append(1) or real(*a))
    q, k, v = _qkv()
    dq, dk, dv = _qkv(seed=1)
    _, want = torch.func.jvp(_math, (q, k, v), (dq, dk, dv))
    with another_thread_compiling() as process_wide_flag:
        with fwAD.dual_level():
            out = attention_core.scaled_dot_product_attention(
                fwAD.make_dual(q, dq), fwAD.make_dual(k, dk), fwAD.make_dual(v, dv))
            tangent = fwAD.unpack_dual(out).tangent
            active_on_plain = tangents.forward_mode_active((q,))
    assert plain == [], f"plain ops ran (is_compiling() on this thread: {process_wide_flag})"
    assert (tangent - want).abs().max() < 1e-10
    assert active_on_plain is False


def test_a_head_split_uses_its_device_threads_and_logs_while_another_thread_compiles(monkeypatch, caplog):
    """A head split over two devices (two CPUs here) while another thread compiles: each group on its own worker
    thread and the split logged, as in any eager call (before, on torch 2.14: both groups ran on the calling thread,
    unlogged, as inside a trace); the result is math's."""
    threads, real = [], multidevice.scaled_dot_product_attention
    monkeypatch.setattr(multidevice, "scaled_dot_product_attention",
                        lambda *a, **kw: threads.append(threading.get_ident()) or real(*a, **kw))
    q, k, v = _qkv(heads=4)
    with another_thread_compiling():
        assert multidevice.in_calling_thread_only((q, k, v, None)) is False
        with caplog.at_level(logging.DEBUG, logger="attention_core.multidevice"):
            out = multidevice.scaled_dot_product_attention_on_devices(q, k, v, devices=["cpu", "cpu"])
    assert (out - _math(q, k, v)).abs().max() < 1e-12
    assert len(threads) == 2 and threading.get_ident() not in threads, threads
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("attention on 2 devices")]


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_a_make_fx_trace_of_a_head_split_records_every_group(mode):
    """make_fx (what torch.export's non-strict mode and AOT tracing run on) traces this thread only: the head
    split runs its groups in the calling thread under a dispatch mode, so the graph holds both groups' attention
    and gives math's answer on new inputs (before: the groups ran on worker threads, outside the trace, and the
    graph returned the traced inputs' result as a constant, or failed on fake tensors)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    q, k, v = _qkv(heads=4)

    def split(a, b, c):
        return multidevice.scaled_dot_product_attention_on_devices(a, b, c, devices=["cpu", "cpu"])
    gm = make_fx(split, tracing_mode=mode)(q, k, v)
    q2, k2, v2 = _qkv(heads=4, seed=7)
    assert (gm(q2, k2, v2) - _math(q2, k2, v2)).abs().max() < 1e-12
    assert sum("fwd" in str(n.target) for n in gm.graph.nodes) == 2, gm.graph

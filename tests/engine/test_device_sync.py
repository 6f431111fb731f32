"""attention_core.device.sync: every timing (bench, tune, calibrate, predict_step) waits for the device's queued work
before it reads the clock. The backends' wait functions are stand-ins here (no GPU): the test checks which one is
called, with which device, and that the CPU calls none."""
import pytest
import torch

from attention_core.device.sync import synchronize


@pytest.fixture
def waits(monkeypatch):
    calls = []
    for name in ("cuda", "xpu", "mps"):
        monkeypatch.setattr(getattr(torch, name), "synchronize",
                            lambda *a, _n=name: calls.append((_n,) + tuple(str(x) for x in a)))
    return calls


@pytest.mark.parametrize("device, want", [("cuda", ("cuda", "cuda")), ("cuda:1", ("cuda", "cuda:1")),
                                          ("xpu:0", ("xpu", "xpu:0")), ("mps", ("mps",))])
def test_each_gpu_backend_waits_on_its_own_device(waits, device, want):
    synchronize(device)
    synchronize(torch.device(device))
    assert waits == [want, want]


def test_the_cpu_waits_for_nothing(waits):
    synchronize("cpu")
    synchronize(torch.device("cpu"))
    assert waits == []


def test_tune_waits_on_the_device_it_times(waits, monkeypatch):
    """tune's timing loop goes through the same wait: on an XPU it must wait on the XPU (before: only CUDA waited,
    so an XPU or MPS tile would have been chosen from launch times). Device work is stood in by the CPU."""
    from attention_core.cli import tune
    seen = []
    monkeypatch.setattr(tune, "synchronize", lambda d: seen.append(str(torch.device(d))))
    tune.layout_check(heads=2, n=256, dim=16, dtype="float32", device="cpu", rows=64, rounds=1, log=lambda *a: None)
    assert seen and set(seen) == {"cpu"}


def test_a_backend_without_synchronize_reads_one_value_back(monkeypatch):
    """DirectML (privateuseone) and other backends without torch.<type>.synchronize: one value read back to the
    host, which an in-order queue returns after the work queued before it (stood in by a recording torch.zeros)."""
    monkeypatch.delattr(torch.xpu, "synchronize")
    made = []
    real_zeros = torch.zeros

    def zeros(*shape, device=None, **kw):
        made.append(str(device))
        return real_zeros(*shape, **kw)
    monkeypatch.setattr(torch, "zeros", zeros)
    synchronize("xpu:1")
    assert made == ["xpu:1"]

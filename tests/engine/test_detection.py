"""Detection with faked device properties, the backend probe, and the self-check."""
import types

import pytest
import torch
import torch.nn.functional as F

import attention_core.device.detection as detect_mod
from attention_core import detect
from attention_core.device.detection import report_from_properties


@pytest.mark.parametrize("arch,fused,needs,bf16", [
    ("gfx906:sramecc+:xnack-", [], True, False),
    ("gfx1030", [], True, False),
    ("gfx90a:sramecc+:xnack-", ["flash", "efficient"], False, True),
])
def test_amd_reports(arch, fused, needs, bf16):
    r = report_from_properties("cuda:0", "AMD Radeon", hip=True, arch=arch, fused_backends=fused)
    assert r.vendor == "amd" and r.gfx == arch.split(":")[0]
    assert r.needs_tiled_attention is needs and r.bf16_hardware is bf16
    assert (arch.split(":")[0] in r.summary())


def test_tables_stand_in_when_the_probe_cannot_run():
    assert report_from_properties("cuda:1", "MI50", hip=True, arch="gfx906").needs_tiled_attention
    assert report_from_properties("cuda:1", "MI50", hip=True, arch="gfx906").known_no_fused
    assert not report_from_properties("cuda:0", "7900", hip=True, arch="gfx1100").needs_tiled_attention


def test_nvidia_sm86():
    r = report_from_properties("cuda:0", "RTX 3090", hip=False, major=8, minor=6, fused_backends=["flash"])
    assert r.sm == "8.6" and r.bf16_hardware and not r.needs_tiled_attention


@pytest.mark.parametrize("kw,needs,reason", [
    (dict(hip=False, major=8, minor=6, fused_backends=[]), True, "no fused SDPA backend runs here"),
    (dict(hip=False, major=9, minor=0, fused_backends=["flash", "efficient"]), False,
     "torch's flash, efficient attention runs"),
    (dict(hip=False, major=4, minor=0), True, "sm_40: from the arch table"),
    (dict(hip=False, major=7, minor=5), False, "sm_75: from the arch table"),
    (dict(hip=True, arch="gfx906:sramecc+:xnack-", fused_backends=[]), True, "no fused SDPA backend runs on gfx906"),
    (dict(hip=True, arch="gfx942", fused_backends=["flash"]), False, "torch's flash attention runs on gfx942"),
    (dict(hip=True, arch="gfx906"), True,
     "gfx906 is known to lack fused attention (no MFMA for CK, rejected by AOTriton)"),
    (dict(hip=True, arch="gfx1100"), False, "gfx1100: from the arch table"),
])
def test_the_verdict_says_why(kw, needs, reason):
    """Each verdict comes with the reason the report and the nodes print: the probe's finding when it ran, else
    the arch table's (NVIDIA and AMD alike)."""
    r = report_from_properties("cuda:0", "GPU", **kw)
    assert r.needs_tiled_attention is needs and r.reason == reason and r.probed == ("fused_backends" in kw)


def test_detect_per_device_with_faked_torch(monkeypatch):
    """detect() on a faked ROCm machine with a gfx906 and a gfx1030, the probe finding nothing."""
    props = {0: types.SimpleNamespace(name="AMD Instinct MI50", gcnArchName="gfx906:sramecc+:xnack-", major=9,
                                      minor=0),
             1: types.SimpleNamespace(name="Radeon RX 6800", gcnArchName="gfx1030", major=10, minor=3)}
    monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props[torch.device(d).index])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(detect_mod, "probe_fused_backends", lambda d: [])
    monkeypatch.setattr(detect_mod, "_cache", {})
    r0, r1 = detect("cuda:0"), detect("cuda:1")
    assert (r0.gfx, r1.gfx) == ("gfx906", "gfx1030")
    assert r0.needs_tiled_attention and r1.needs_tiled_attention and not r0.bf16_hardware
    assert "gfx906" in r0.text() and "needs tiled attention: yes" in r0.text()
    assert not detect_mod.bf16_hardware("cuda:0")


def test_env_override(monkeypatch):
    monkeypatch.setenv("TILED_ATTENTION", "force")
    assert detect("cpu").needs_tiled_attention and detect("cpu").override == "force"
    monkeypatch.setenv("TILED_ATTENTION", "off")
    assert not detect("cpu").needs_tiled_attention


def test_cpu_probe_is_ground_truth():
    r = detect("cpu", refresh=True)
    assert r.probed and r.vendor == "cpu"
    assert r.needs_tiled_attention == (not r.fused_backends)


def test_selfcheck_passes_on_this_device(capsys):
    from attention_core.cli import selfcheck
    assert selfcheck.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "needs tiled attention" in out and "all cases within tolerance" in out and "BAD" not in out
    # what it did not check on this device is said, with the reason, never silently left out
    assert "skipped float16 and bfloat16 cases: half-precision attention is checked on GPUs" in out
    assert "skipped fp16 overflowing scores" in out


def test_probe_leaves_torch_backend_switches_alone(monkeypatch):
    """The probe used to run each backend under sdpa_kernel, flipping torch's process-global switches: other
    threads' plain SDPA calls then failed with "No viable backend". Now nothing global changes."""
    import threading
    q = torch.randn(1, 2, 16, 8)
    errors, calls, stop = [], [0], threading.Event()

    def hammer():
        while not stop.is_set():
            try:
                F.scaled_dot_product_attention(q, q, q)
                calls[0] += 1
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))

    flags = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled(),
             torch.backends.cuda.mem_efficient_sdp_enabled())
    switched = []
    for name in [n for n in dir(torch._C) if n.startswith("_set_sdp_use_") or n == "_set_sdp_priority_order"]:
        real = getattr(torch._C, name)
        monkeypatch.setattr(torch._C, name, lambda *a, _n=name, _r=real: switched.append(_n) or _r(*a))
    t = threading.Thread(target=hammer)
    t.start()
    try:
        for _ in range(20):
            detect("cpu", refresh=True)
    finally:
        stop.set()
        t.join()
    assert switched == []  # deterministic: no global switch was touched
    assert calls[0] > 0 and errors == []
    assert flags == (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled(),
                     torch.backends.cuda.mem_efficient_sdp_enabled())


def test_probe_finds_the_cpu_flash_kernel():
    assert "flash" in detect_mod.probe_fused_backends(torch.device("cpu"))


def test_the_gpu_probe_takes_each_fused_kernels_attention_output(monkeypatch):
    """On a GPU the probe calls torch's fused kernels as aten ops, whose results are tuples (output, logsumexp,
    ..., debug mask last): each probe must hand on the first element, the attention output. Checked on the CPU
    with stand-in ops of the same arity (torch 2.x signatures) that compute math SDPA (a probe taking another
    element, e.g. cuDNN's debug mask, would call a working kernel broken; a causal or dropout call differs too)."""
    calls = {}

    def fake(name, extra):
        def op(q, k, v, *args):
            calls[name] = args
            out = F.scaled_dot_product_attention(q, k, v)
            return (out, torch.zeros(q.shape[:-1]), *[torch.empty(0)] * extra)
        return op

    aten = types.SimpleNamespace(
        _scaled_dot_product_flash_attention=fake("flash", 7),  # out, lse, cum_q, cum_k, max_q, max_k, rng, _, dbg
        _scaled_dot_product_efficient_attention=fake("efficient", 2),  # out, lse, philox seed, offset
        _scaled_dot_product_cudnn_attention=fake("cudnn", 7))  # out, lse, cum_q, cum_k, max_q, max_k, seed, off, dbg
    monkeypatch.setattr(detect_mod, "torch", types.SimpleNamespace(ops=types.SimpleNamespace(aten=aten)))
    ops = detect_mod._fused_ops(torch.device("cuda", 0))
    monkeypatch.undo()
    assert sorted(ops) == ["cudnn", "efficient", "flash"]
    q = torch.randn(1, 2, 32, 64, generator=torch.Generator().manual_seed(0))
    want = F.scaled_dot_product_attention(q, q, q)
    for name, probe in ops.items():
        assert torch.equal(probe(q), want), name
    assert sorted(calls) == ["cudnn", "efficient", "flash"]  # each probe called its own kernel
    # plain attention: no mask, no log-sum-exp asked of cuDNN, no dropout, not causal
    assert calls == {"flash": (), "efficient": (None, False), "cudnn": (None, False, 0.0, False)}
    assert [type(x) for x in calls["cudnn"]] == [type(None), bool, float, bool]

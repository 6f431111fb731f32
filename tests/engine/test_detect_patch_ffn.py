"""Detection with faked device properties, the global patch, and exact FFN chunking."""
import types

import pytest
import torch
import torch.nn.functional as F

import attention_core
import attention_core.detection as detect_mod
from attention_core import chunk_ffn, detect, unchunk_ffn
from attention_core.detection import report_from_properties


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


def test_import_patches_nothing():
    import importlib
    original = F.scaled_dot_product_attention
    importlib.reload(attention_core)
    assert F.scaled_dot_product_attention is original and not attention_core.is_enabled()


def test_enable_disable_restores_original(monkeypatch):
    original = F.scaled_dot_product_attention
    calls = []
    import attention_core.sdpa as sd
    real = sd.scaled_dot_product_attention
    monkeypatch.setattr(sd, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    q = torch.randn(1, 2, 8, 4)
    try:
        attention_core.enable(force=True, tier="online")
        assert attention_core.is_enabled() and F.scaled_dot_product_attention is not original
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        assert calls == [1]
        assert torch.allclose(out, original(q, q, q, is_causal=True), atol=1e-6)
        attention_core.enable(force=True)  # twice: no double wrap
        F.scaled_dot_product_attention(q, q, q)
        assert calls == [1, 1]
    finally:
        attention_core.disable()
    assert F.scaled_dot_product_attention is original and not attention_core.is_enabled()
    with attention_core.patched(force=True):
        F.scaled_dot_product_attention(q, q, q)
    assert calls == [1, 1, 1] and F.scaled_dot_product_attention is original


def test_patch_passes_through_when_not_needed(monkeypatch):
    monkeypatch.setenv("TILED_ATTENTION", "off")
    import attention_core.sdpa as sd
    monkeypatch.setattr(sd, "scaled_dot_product_attention", lambda *a, **k: pytest.fail("engine used"))
    q = torch.randn(1, 2, 8, 4)
    with attention_core.patched():
        F.scaled_dot_product_attention(q, q, q)


class TokenMixer(torch.nn.Module):
    def forward(self, x):
        return x - x.mean(dim=1, keepdim=True)


def test_chunk_ffn_exact_and_keys_untouched():
    torch.manual_seed(11)
    ffn = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(64, 16))
    x = torch.randn(2, 50, 16)
    ref = ffn(x)
    keys = list(ffn.state_dict())
    w = chunk_ffn(ffn, chunks=7)
    out = ffn(x)
    assert torch.equal(out, ref) or torch.allclose(out, ref, atol=1e-6)
    assert w.verified and w.calls_chunked == 1 and list(ffn.state_dict()) == keys
    assert w.hidden == 64
    unchunk_ffn(ffn)
    assert "forward" not in ffn.__dict__


def test_chunk_ffn_refuses_token_mixing_modules():
    m = TokenMixer()
    w = chunk_ffn(m, chunks=4)
    x = torch.randn(1, 32, 8)
    assert torch.allclose(m(x), x - x.mean(dim=1, keepdim=True))
    assert w.verified is False and w.calls_chunked == 0


def test_chunk_ffn_auto_count_from_memory(monkeypatch):
    import attention_core.ffn as ffn_mod
    monkeypatch.setattr(ffn_mod, "free_memory", lambda d: 1 << 20)
    ffn = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
    w = chunk_ffn(ffn, chunks=0)
    x = torch.randn(1, 4096, 32)
    assert w.chunk_count(x) > 1
    assert torch.allclose(ffn(x), w.forward(x), atol=1e-6)


def test_selfcheck_passes_on_this_device(capsys):
    from attention_core import selfcheck
    assert selfcheck.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "needs tiled attention" in out and "all cases within tolerance" in out and "BAD" not in out

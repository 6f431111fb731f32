"""The chunked tier's score layout (issue 18.4): keys-major S^T = K Q^T is torch's attention like queries-major,
the profile's per-dtype layout (written by `tune`, validated on load) selects it, TILED_ATTENTION_LAYOUT
overrides it, and calls it does not apply to (mask, causal, dropout) run queries-major."""

import pytest
import torch

from attention_core.device import profiles
from attention_core.cli import tune
from attention_core import scaled_dot_product_attention as sdpa
from attention_core.kernel.tiers import TIERS, chunked
from reference import math_sdpa, reference, reference_grads


@pytest.fixture
def keys_runs(monkeypatch):
    """Counts the chunked tier's keys-major loops."""
    calls = []
    real = chunked._forward_keys_major

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)
    monkeypatch.setattr(chunked, "_forward_keys_major", spy)
    return calls


def write_profile(layouts, entries=()):
    prof = {"version": profiles.PROFILE_VERSION, "device": "x", "arch": "y", "torch": torch.__version__,
            "entries": list(entries), "layouts": layouts}
    return profiles.save_profile(prof, "cpu")


def close(a, b, tol=1e-9):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a.double() - b).abs().max().item()
    assert err <= tol, f"max error {err:.3g}"


CASES = ["plain", "gqa", "scale", "broadcast", "3d", "bool_mask", "causal"]


@pytest.mark.parametrize("layout", ["queries", "keys"])
@pytest.mark.parametrize("case", CASES)
def test_both_layouts_are_torch_attention_forward_and_backward(profdir, monkeypatch, keys_runs, layout, case):
    """float64, the bounds of test_sdpa_autograd; the keys-major loop runs exactly where it applies (no mask, no
    causal) and the others fall back to queries-major."""
    monkeypatch.setenv(profiles.ENV_LAYOUT, layout)
    torch.manual_seed(3)
    hq, hkv, lq, lk = 4, 4, 13, 17
    kw, mask = {}, None
    if case == "gqa":
        hkv, kw = 2, {"enable_gqa": True}
    shapes = [(2, hq, lq, 8), (2, hkv, lk, 8), (2, hkv, lk, 6)]
    if case == "broadcast":
        shapes = [(2, hq, lq, 8), (1, 1, lk, 8), (1, 1, lk, 6)]
    elif case == "3d":
        shapes = [(3, lq, 8), (3, lk, 8), (3, lk, 6)]
    q, k, v = (torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in shapes)
    if case == "bool_mask":
        mask = torch.rand(2, hq, lq, lk) > 0.3
    elif case == "causal":
        kw = {"is_causal": True}
    elif case == "scale":
        kw = {"scale": 0.41}
    dout = torch.randn(q.shape[:-2] + (lq, v.shape[-1]), dtype=torch.float64)
    if case == "broadcast":
        dout = torch.randn(2, hq, lq, 6, dtype=torch.float64)
    ref_out, ref_grads = reference_grads(q, k, v, dout, mask, **kw)
    out = sdpa(q, k, v, mask, tier="chunked", block_q=4, **kw)
    close(out.detach(), ref_out)
    out.backward(dout)
    for g, r in zip((q.grad, k.grad, v.grad), ref_grads):
        close(g, r)
    applies = layout == "keys" and case not in ("bool_mask", "causal")
    assert len(keys_runs) == (1 if applies else 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_keys_major_in_fp32_and_fp16_within_torchs_own_error(profdir, monkeypatch, keys_runs, dtype):
    """fp32: within 2x torch's own math-SDPA error (as test_sdpa_numerics); fp16 (flush-to-zero, row statistics
    for the backward): within the fp16 bound of the numerics tests."""
    monkeypatch.setenv(profiles.ENV_LAYOUT, "keys")
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 3, n, 32, generator=g).to(dtype).requires_grad_(True) for n in (70, 90, 90))
    ref = reference(q, k, v)
    out = sdpa(q, k, v, tier="chunked", block_q=16, precision="keep")
    err = (out.detach().double() - ref).abs().max()
    if dtype == torch.float32:
        torch_err = (math_sdpa(q.detach(), k.detach(), v.detach()).double() - ref).abs().max()
        assert err <= max(2 * torch_err, 1e-6), (err, torch_err)
    else:
        assert err < 1e-2
    out.float().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert keys_runs


def test_the_profiles_layout_selects_the_keys_major_loop(profdir, keys_runs, monkeypatch):
    """tier auto and a forced chunked tier both run the layout the profile names for the call's dtype."""
    seen = []
    real = TIERS["chunked"]
    monkeypatch.setitem(TIERS, "chunked", lambda *a, **kw: seen.append(kw.get("layout")) or real(*a, **kw))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 64, 16, generator=g) for _ in range(3))
    ref = math_sdpa(q.double(), k.double(), v.double())
    sdpa(q, k, v, tier="chunked")  # no profile: the device's default (queries-major on the CPU, measured quiet)
    assert seen == [profiles.DEFAULT_LAYOUT["cpu"]] == ["queries"] and not keys_runs
    seen.clear(), keys_runs.clear()
    write_profile({"float32": "keys", "float64": "queries"})
    for tier in ("auto", "chunked"):
        assert (sdpa(q, k, v, tier=tier).double() - ref).abs().max() < 1e-5
    assert seen == ["keys", "keys"] and len(keys_runs) == 2
    sdpa(q.double(), k.double(), v.double(), tier="chunked")
    assert seen[-1] == "queries" and len(keys_runs) == 2
    monkeypatch.setenv(profiles.ENV_SWITCH, "off")  # profiles ignored: the device's default
    assert profiles.score_layout("cpu", torch.float32) == profiles.DEFAULT_LAYOUT["cpu"]
    monkeypatch.setenv(profiles.ENV_LAYOUT, "queries")  # the override wins over everything
    monkeypatch.delenv(profiles.ENV_SWITCH)
    assert profiles.score_layout("cpu", torch.float32) == "queries"


@pytest.mark.parametrize("layouts", [{"float32": "diagonal", "float16": "keys"}, {"float32": 3, "float16": "keys"},
                                     "keys", ["keys"]])
def test_bad_layouts_in_a_profile_are_dropped_with_one_warning(profdir, caplog, layouts):
    path = write_profile(layouts)
    with caplog.at_level("WARNING"):
        assert profiles.score_layout("cpu", torch.float32) == profiles.DEFAULT_LAYOUT["cpu"]
        want16 = "keys" if isinstance(layouts, dict) else profiles.DEFAULT_LAYOUT["cpu"]
        assert profiles.score_layout("cpu", torch.float16) == want16
        q = torch.randn(1, 2, 32, 8)
        assert (sdpa(q, q, q).double() - math_sdpa(q.double(), q.double(), q.double())).abs().max() < 1e-5
    warned = [r.getMessage() for r in caplog.records if path in r.getMessage()]
    assert len(warned) == 1 and "layouts" in warned[0], warned


def test_tune_keeps_the_faster_layout_per_dtype(profdir, monkeypatch):
    """tune measures both layouts at every shape (interleaved rounds, medians: layout_check) and stores the one
    with the smaller total; a profile written so is read back by the engine."""
    monkeypatch.setattr(tune, "tune_shape", lambda *a, **kw: {})
    ms = {"float32": (10.0, 8.0), "float64": (8.0, 10.0)}
    seen = []

    def fake_check(heads, n, dim, dtype, device, rows, rounds, log=print):
        seen.append((heads, n, rounds))
        return {"queries_major_ms": ms[dtype][0], "keys_major_ms": ms[dtype][1]}
    monkeypatch.setattr(tune, "layout_check", fake_check)
    prof = tune.tune("cpu", ["float32", "float64"], [(4, 256, 32), (8, 512, 32)], ["chunked"], 64, 1,
                     log=lambda s: None)
    assert prof["layouts"] == {"float32": "keys", "float64": "queries"}
    assert seen == [(4, 256, tune.LAYOUT_ROUNDS), (8, 512, tune.LAYOUT_ROUNDS)] * 2
    assert "layouts" not in tune.tune("cpu", ["float32"], [(4, 256, 32)], ["online"], 64, 1, log=lambda s: None)
    prof["entries"] = []
    profiles.save_profile(prof, "cpu")
    assert profiles.score_layout("cpu", torch.float32) == "keys"
    assert profiles.score_layout("cpu", torch.float64) == "queries"
    assert tune.pick_layout([{"queries_major_ms": 5.0, "keys_major_ms": 5.0}]) == "queries"  # tie: queries


def test_an_unknown_layout_override_warns_once(monkeypatch, caplog):
    import logging
    from attention_core.device import profiles
    monkeypatch.setenv(profiles.ENV_LAYOUT, "colums")
    profiles._warned_layouts.discard("colums")
    with caplog.at_level(logging.WARNING):
        first = profiles.score_layout("cpu", torch.float32)
        profiles.score_layout("cpu", torch.float32)
    assert first in profiles.LAYOUTS
    warnings = [r.getMessage() for r in caplog.records if "TILED_ATTENTION_LAYOUT" in r.getMessage()]
    assert len(warnings) == 1 and "'colums'" in warnings[0] and "queries, keys" in warnings[0]

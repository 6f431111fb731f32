"""attention_core.calibrate (`python -m attention_core.calibrate`: measured rates) and attention_core.device.calibration
(where the file lives, what a usable one holds, the messages for a bad one).

Measuring on real model shapes takes tens of seconds, so `measure` runs here on a made-up tiny model with the
timer replaced (the rates are then exact arithmetic); `main` runs with `measure` replaced, to pin its defaults,
its output lines and its error line.
"""
import json
import logging
import os
import re
import types

import pytest
import torch

from attention_core.cli import bench, bench_methods, calibrate, cli_args, plan
from attention_core.device import calibration, profiles


def _calib():
    return {"version": 2, "device": "test device", "dtype": "fp32", "date": "2026-12-01 12:00 UTC",
            "attention": {"pack": [{"tokens": 1024, "gflops": 100.0}], "math": [{"tokens": 1024, "gflops": 9}]},
            "gemm": [{"m": 512, "k": 3072, "n": 3072, "gflops": 200.0}]}


# --------------------------------------------------------------------------------------------- the file
@pytest.mark.parametrize("change, problem", [
    (lambda d: [d], "not a JSON object"),
    (lambda d: {**d, "version": 3}, "version 3 is not 1 or 2"),
    (lambda d: {**d, "version": True}, "version True is not 1 or 2"),
    (lambda d: {k: v for k, v in d.items() if k != "version"}, "version None is not 1 or 2"),
    (lambda d: {**d, "torch_default": ""}, "'torch_default' is missing or not a string"),
    (lambda d: {**d, "torch_default": "flash\nattention"},
     "'torch_default' is not one line of printable text of at most 200 characters"),
    (lambda d: {**d, "upgraded_from": 2}, "'upgraded_from' 2 is not 1 in a version 2 calibration"),
    (lambda d: {**d, "version": 1, "upgraded_from": 1}, "'upgraded_from' 1 is not 1 in a version 2 calibration"),
    (lambda d: {**d, "version": 1, "attention": {**d["attention"], "torch": []}},
     "attention kind 'torch' is unknown or not a list"),
    (lambda d: {**d, "device": ""}, "'device' is missing or not a string"),
    (lambda d: {**d, "date": 5}, "'date' is missing or not a string"),
    (lambda d: {k: v for k, v in d.items() if k != "dtype"}, "'dtype' is missing or not a string"),
    (lambda d: {**d, "attention": []}, "'attention' has no 'pack' measurements"),
    (lambda d: {**d, "attention": {"math": d["attention"]["math"]}}, "'attention' has no 'pack' measurements"),
    (lambda d: {**d, "attention": {"pack": []}}, "'attention' has no 'pack' measurements"),
    (lambda d: {**d, "attention": {"pack": {"tokens": 1}}}, "'attention' has no 'pack' measurements"),
    (lambda d: {**d, "attention": {**d["attention"], "flash": []}}, "attention kind 'flash' is unknown or not a list"),
    (lambda d: {**d, "attention": {**d["attention"], "subquad": {}}},
     "attention kind 'subquad' is unknown or not a list"),
    (lambda d: {**d, "attention": {"pack": [{"tokens": 0, "gflops": 5}]}},
     "attention entry 0 of 'pack': 'tokens' 0 is not a number from 1 to 1,000,000,000"),
    (lambda d: {**d, "attention": {"pack": [{"tokens": 9, "gflops": 1}], "math": [{"tokens": 9, "gflops": -1}]}},
     "attention entry 0 of 'math': 'gflops' -1 is not a number from 1e-06 to 10,000,000"),
    (lambda d: {**d, "attention": {"pack": [{"tokens": 9}]}},
     "attention entry 0 of 'pack': 'gflops' None is not a number from 1e-06 to 10,000,000"),
    (lambda d: {**d, "attention": {"pack": [[9, 1]]}},
     "attention entry 0 of 'pack': list instead of an object"),
    (lambda d: {**d, "gemm": []}, "'gemm' needs a non-empty list of measurements"),
    (lambda d: {k: v for k, v in d.items() if k != "gemm"}, "'gemm' needs a non-empty list of measurements"),
    (lambda d: {**d, "gemm": [5]}, "gemm entry 0: int instead of an object"),
    (lambda d: {**d, "gemm": d["gemm"] + [{"n": 3072, "gflops": 0}]},
     "gemm entry 1: 'gflops' 0 is not a number from 1e-06 to 10,000,000"),
    (lambda d: {**d, "gemm": d["gemm"] + [{"gflops": 5}]}, "gemm entry 1: 'n' None is not a whole number from 1 to "
                                                           "1,048,576"),
    # optional fields, checked when present (the estimate takes their logarithms): rows m, input width k, and the
    # elementwise bandwidth
    (lambda d: {**d, "gemm": [{**d["gemm"][0], "m": 0}]}, "gemm entry 0: 'm' 0 is not a whole number from 1 to "
                                                           "1,048,576"),
    (lambda d: {**d, "gemm": [{**d["gemm"][0], "m": "512"}]}, "gemm entry 0: 'm' '512' is not a whole number from "
                                                               "1 to 1,048,576"),
    (lambda d: {**d, "gemm": [{**d["gemm"][0], "k": 3072.5}]}, "gemm entry 0: 'k' 3072.5 is not a whole number "
                                                                "from 1 to 1,048,576"),
    (lambda d: {**d, "gemm": [{**d["gemm"][0], "k": None}]}, "gemm entry 0: 'k' None is not a whole number from 1 "
                                                              "to 1,048,576"),
    (lambda d: {**d, "elementwise": []}, "'elementwise' is not a non-empty list of measurements"),
    (lambda d: {**d, "elementwise": {"gbps": 5}}, "'elementwise' is not a non-empty list of measurements"),
    (lambda d: {**d, "elementwise": [{"gbps": 0}]}, "elementwise entry 0: 'gbps' 0 is not a number from 1e-06 to "
                                                     "100,000"),
    (lambda d: {**d, "elementwise": [{"gbps": 5.0}, {"gbps": 1e6}]},
     "elementwise entry 1: 'gbps' 1000000.0 is not a number from 1e-06 to 100,000"),
    (lambda d: {**d, "elementwise": [{"rows": 4096}]}, "elementwise entry 0: 'gbps' None is not a number from 1e-06 "
                                                        "to 100,000"),
])
def test_validate_names_what_is_wrong(change, problem):
    """The first problem of a bad calibration, as the load warning and save's error show it."""
    assert calibration.validate(change(_calib())) == problem


@pytest.mark.parametrize("bad", [True, float("inf"), float("nan"), "5", None, 0, -0.5])
def test_rates_must_be_positive_finite_numbers(bad):
    """A rate divides FLOPs into seconds: a boolean, infinite, NaN, text, zero or negative one is refused."""
    assert calibration.validate({**_calib(), "gemm": [{"n": 3072, "gflops": bad}]}) is not None
    assert calibration.validate({**_calib(), "attention": {"pack": [{"tokens": 1024, "gflops": bad}]}}) is not None
    assert calibration.validate({**_calib(), "attention": {"pack": [{"tokens": bad, "gflops": 1.0}]}}) is not None


def test_gemm_rows_and_widths_and_the_elementwise_rate_are_optional():
    """A calibration from before issue 24 (no elementwise rate), or a GEMM entry without m or k, stays valid."""
    base = _calib()
    assert "elementwise" not in base and calibration.validate(base) is None
    assert calibration.validate({**base, "gemm": [{"n": 3072, "gflops": 1.0}]}) is None
    assert calibration.validate({**base, "elementwise": [{"rows": 4096, "width": 3072, "gbps": 12.5}]}) is None
    assert calibration.validate({**base, "gemm": [{"m": 1, "k": 2 ** 20, "n": 1, "gflops": 1.0}]}) is None


def test_a_usable_calibration_round_trips(tmp_path):
    """Whole and fractional positive rates, all three attention kinds: valid, saved and loaded back unchanged."""
    data = {**_calib(), "attention": {"pack": [{"tokens": 1, "gflops": 1e-3}], "subquad": [],
                                      "math": [{"tokens": 64, "gflops": 3}]}}
    assert calibration.validate(data) is None
    path = str(tmp_path / "c.json")
    assert calibration.save(data, path) == path
    assert calibration.load(path) == data
    assert calibration.load(str(tmp_path / "missing.json")) is None


def test_a_bad_file_warns_once_with_the_problem_and_the_fix(tmp_path, caplog):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({**_calib(), "version": 3}))
    with caplog.at_level(logging.WARNING):
        assert calibration.load(str(path)) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"tiled attention: the calibration {path} is not usable as written (ignoring the file): version 3 is not 1 or 2. "
        "Run python -m attention_core.calibrate again."]


def test_save_refuses_an_invalid_calibration_and_writes_nothing(tmp_path):
    path = str(tmp_path / "c.json")
    with pytest.raises(ValueError) as e:
        calibration.save({**_calib(), "gemm": []}, path)
    assert str(e.value) == (f"not saving an invalid calibration to {path}: "
                            "'gemm' needs a non-empty list of measurements")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name, arch, slug", [
    ("AMD Ryzen 9 7950X 16-Core Processor", "x86_64", "amd-ryzen-9-7950x-16-core-processor-x86-64"),
    ("NVIDIA H200", "sm_90", "nvidia-h200-sm-90"),
    ("(R)", "--", "r"),
    ("", "", "device"),
    ("x" * 100, "y", "x" * 80),
])
def test_calibration_file_is_named_for_the_device_and_dtype(profdir, monkeypatch, name, arch, slug):
    """calibration-<device name and arch, lower case, runs of other characters as one '-', at most 80>-<dtype>.json
    in the profile folder; a name with no letters or digits at all is 'device'."""
    monkeypatch.setattr(profiles, "_device_name", lambda device: (name, arch))
    assert calibration.calibration_path("cpu", "bf16") == str(profdir / f"calibration-{slug}-bf16.json")
    assert calibration.calibration_path() == str(profdir / f"calibration-{slug}-fp32.json")


# --------------------------------------------------------------------------------------------- measuring
def test_attention_flops_counts_both_gemms():
    """QK^T and PV: 2 GEMMs of 2 * heads * N * keys * head_dim FLOPs; keys default to N (self-attention)."""
    assert calibrate.attention_flops(8, 1024, 128) == 4 * 8 * 1024 * 1024 * 128
    assert calibrate.attention_flops(2, 10, 64, keys=7) == 4 * 2 * 10 * 7 * 64


def test_best_is_the_fastest_of_the_repeats_after_a_warm_up(monkeypatch):
    """The first call (allocations, dispatch) is not timed; then `repeats` timed calls, the fastest counts."""
    clock = iter([0.0, 5.0, 10.0, 12.0, 20.0, 23.0])   # timed calls: 5 s, 2 s, 3 s
    monkeypatch.setattr(calibrate, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    calls = []
    assert calibrate._best(lambda: calls.append(1), 3) == 2.0
    assert len(calls) == 4
    assert calibrate._best(lambda: calls.append(1), 0) == float("inf")


def test_interleaved_rounds_alternate_the_methods_and_keep_each_ones_median(monkeypatch):
    """Each function warmed up once, then `rounds` rounds of one call each in order (a, b, a, b, ...), so a load
    that comes and goes hits both; each keeps the median of its rounds, and with a monitor each call runs in its
    own span (the readings of all its rounds in one figure)."""
    from attention_core.device import machine_load
    clock = iter([0.0, 1.0, 1.0, 5.0, 5.0, 8.0, 8.0, 9.0, 9.0, 11.0, 11.0, 20.0])  # a: 1, 3, 2; b: 4, 1, 9
    monkeypatch.setattr(calibrate, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    calls = []
    readings = iter(range(100))
    monitor = machine_load.Monitor(source=lambda: next(readings))
    got = calibrate.interleaved(monitor, {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 3)
    assert calls == ["a", "b"] + ["a", "b"] * 3
    assert got == {"a": 2.0, "b": 4.0}
    assert [len(monitor.figures[k].samples) for k in "ab"] == [3, 3]


@pytest.fixture
def tiny(monkeypatch):
    """A made-up model (2 heads of 8, FFN 48), a fixed device name, each measurement taking 0.5 s."""
    spec = plan.ModelSpec("tiny", "tiny", (1, 1, 1), (1, 1, 1), 2, 8, 48, 1, "test")
    monkeypatch.setitem(plan.MODELS, "tiny", spec)
    monkeypatch.setattr(profiles, "_device_name", lambda device: ("Test CPU", "x86_64"))
    timed = []

    def best(fn, repeats):
        fn()
        timed.append(repeats)
        return 0.5

    def interleaved(monitor, fns, rounds):
        for fn in fns.values():
            fn()
        timed.append((sorted(fns), rounds))
        return {key: 0.5 for key in fns}
    monkeypatch.setattr(calibrate, "_best", best)
    monkeypatch.setattr(calibrate, "interleaved", interleaved)
    return timed


def test_measure_on_a_tiny_model(tiny, monkeypatch):
    """Rates are FLOPs over the time in GFLOP/s, for the engine at each token count, for torch's math SDPA
    while the scores (8 heads x N^2) stay within MATH_MAX_SCORES (those two in interleaved rounds, median), and for
    GEMMs of GEMM_ROWS rows at the model's width x width and width x FFN shapes (best of two timed runs by default);
    no ComfyUI: no sub-quadratic entry at all."""
    monkeypatch.setattr(calibrate, "MATH_MAX_SCORES", 8 * 32 * 32)
    monkeypatch.setattr(calibrate, "default_backend", lambda q, k, v: "math")  # torch's default: math SDPA
    data = calibrate.measure("cpu", "fp32", "tiny", tokens=(16, 32, 48))
    assert data["version"] == calibration.VERSION == 2
    assert (data["device"], data["dtype"], data["model"]) == ("Test CPU (x86_64)", "fp32", "tiny")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", data["date"])
    assert data["torch"] == torch.__version__ and data["threads"] == torch.get_num_threads()
    assert calibration.validate(data) is None and sorted(data["attention"]) == ["math", "pack"]
    assert "torch_default" not in data
    rows = [{"tokens": n, "heads": 8, "head_dim": 8, "gflops": 4 * 8 * n * n * 8 / 0.5 / 1e9} for n in (16, 32, 48)]
    assert data["attention"]["pack"] == rows
    assert data["attention"]["math"] == rows[:2]
    # GEMMs at the model's three linear shapes (width x width, the FFN's up and down), at 512 and 4,096 rows
    assert data["gemm"] == [{"m": m, "k": k, "n": n, "gflops": 2 * m * k * n / 0.5 / 1e9}
                            for m in (512, 4096) for k, n in ((16, 16), (16, 48), (48, 16))]
    # five passes over a 4,096 x 16 fp32 activation moving 2 + 2 + 3 + 2 + 3 = 12 elements per element, 0.5 s each
    assert data["elementwise"] == [{"rows": 4096, "width": 16, "gbps": 12 * 4096 * 16 * 4 / 2.5 / 1e9}]
    # the attention methods of each token count in interleaved rounds (3, or more when repeats asks), the rest
    # the best of `repeats` runs
    assert tiny == [([("math", 16), ("pack", 16)], 3), ([("math", 32), ("pack", 32)], 3), ([("pack", 48)], 3)] + [2] * 11
    calibrate.measure("cpu", "fp32", "tiny", tokens=(16,), repeats=5)
    assert tiny[14:] == [([("math", 16), ("pack", 16)], 5)] + [5] * 11  # six GEMMs, five elementwise passes


def test_math_is_math_sdpa_and_torchs_default_a_separate_named_rate(tiny, monkeypatch):
    """Issue 38.4: "math" times torch's math SDPA (only the math backend enabled while it runs), and torch's
    default SDPA (whatever backend torch picks: the fused flash kernel on this CPU) is a rate of its own, "torch",
    at every token count, with its backend named in "torch_default"; neither is the engine (the builtin is
    called even under the global patch)."""
    from attention_core.device import torch_sdpa
    from torch.nn.attention import SDPBackend
    calls = []
    real = torch_sdpa.TORCH_SDPA

    def spy(q, k, v, *a, **kw):
        calls.append((q.shape[2], torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()))
        return real(q, k, v, *a, **kw)
    monkeypatch.setattr(torch_sdpa, "TORCH_SDPA", spy)
    monkeypatch.setattr(calibrate, "MATH_MAX_SCORES", 8 * 32 * 32)
    backend = torch_sdpa.default_backend(*(torch.randn(1, 8, 16, 8),) * 3)
    assert backend == SDPBackend(torch._fused_sdp_choice(*(torch.randn(1, 8, 16, 8),) * 3)).name.lower()
    assert backend == "flash_attention"  # torch's CPU default: what the old "math" measured
    with attention_core_enabled():
        data = calibrate.measure("cpu", "fp32", "tiny", tokens=(16, 32, 48))
    assert sorted(data["attention"]) == ["math", "pack", "torch"] and data["torch_default"] == "flash_attention"
    assert [r["tokens"] for r in data["attention"]["math"]] == [16, 32]
    assert [r["tokens"] for r in data["attention"]["torch"]] == [16, 32, 48]
    # (one call each: the tiny fixture's interleaved) math calls with flash off and math on; default calls with
    # both on, torch's own choice
    assert sorted(calls) == sorted([(n, False, True) for n in (16, 32)] + [(n, True, True) for n in (16, 32, 48)])
    assert tiny[:3] == [([("math", 16), ("pack", 16), ("torch", 16)], 3),
                        ([("math", 32), ("pack", 32), ("torch", 32)], 3), ([("pack", 48), ("torch", 48)], 3)]
    assert calibration.validate(data) is None


def attention_core_enabled():
    """The pack's global patch on (torch.nn.functional's SDPA replaced by the engine) for the with-block."""
    import attention_core
    return attention_core.patched()


def test_a_version_1_file_reads_its_math_as_torchs_default_with_a_note(tmp_path, monkeypatch, capsys):
    """Issue 38.4: a calibration from before (version 1) labelled torch's default SDPA "math". It still loads (its
    pack, sub-quadratic and GEMM rates are right), its "math" read as torch's default with the backend unknown, no
    math SDPA rate, marked upgraded_from 1; the note says so and how to get math SDPA's rate."""
    old = {**_calib(), "version": 1, "attention": {"pack": [{"tokens": 1024, "gflops": 100.0}],
                                                   "subquad": [{"tokens": 1024, "gflops": 50.0}],
                                                   "math": [{"tokens": 1024, "gflops": 9}]}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    got = calibration.load(str(path))
    assert got == {**old, "version": 2, "upgraded_from": 1,
                   "attention": {"pack": old["attention"]["pack"], "subquad": old["attention"]["subquad"],
                                 "torch": [{"tokens": 1024, "gflops": 9}]}}
    assert calibration.validate(got) is None and calibration.problem(str(path)) is None
    assert calibration.note(got) == calibration.V1_NOTE and calibration.note(_calib()) is None
    assert "math SDPA's rate is unknown until python -m attention_core.calibrate runs again" in calibration.V1_NOTE
    assert calibration.kind_note(got, "torch") == " (torch's default SDPA, backend unknown: " + calibration.V1_NOTE + ")"
    assert calibration.kind_note({**_calib(), "torch_default": "flash_attention"}, "torch") == (
        " (torch's default SDPA, backend flash_attention)")
    # the estimate reads the pack's and sub-quadratic's rates of the old file as before
    from attention_core.cli import estimate
    spec = plan.MODELS["wan22-5b"]
    assert estimate.step_time(spec, 4096, got, "pack") == estimate.step_time(spec, 4096, old, "pack")


def test_measure_hands_comfyui_its_own_layout(tiny, monkeypatch):
    """ComfyUI's sub-quadratic attention gets the engine's q, k, v (one batch item, 8 heads, [B, H, N, D]) in its
    own layout, [B, N, H x D], with the head count, in the measured dtype, at the same token counts."""
    from attention_core import sdpa
    engine, got = [], []
    monkeypatch.setattr(sdpa, "scaled_dot_product_attention", lambda q, k, v: engine.append((q, k, v)))

    def subquad(q, k, v, heads):
        want = [t.transpose(1, 2).reshape(1, t.shape[2], 8 * 8) for t in engine[-1]]
        assert engine[-1][0].shape == (1, 8, q.shape[1], 8)
        got.append((tuple(q.shape), q.dtype, heads, all(torch.equal(a, b) for a, b in zip((q, k, v), want))))
    loaded = []
    monkeypatch.setattr(bench_methods, "comfy_attention", lambda path, name: loaded.append((path, name)) or subquad)
    data = calibrate.measure("cpu", "bf16", "tiny", tokens=(16, 24), comfyui="/comfy")
    assert loaded == [("/comfy", "comfy-subquad")]
    assert got == [((1, 16, 64), torch.bfloat16, 8, True), ((1, 24, 64), torch.bfloat16, 8, True)]
    assert not torch.equal(engine[0][0], engine[0][1])  # three different tensors
    assert [r["tokens"] for r in data["attention"]["subquad"]] == [16, 24]
    assert data["attention"]["subquad"][0]["gflops"] == 4 * 8 * 16 * 16 * 8 / 0.5 / 1e9
    assert data["dtype"] == "bf16"


def test_the_default_token_counts_and_shapes():
    """1024, 2048 and 4096 tokens over 8 heads (the math SDPA up to 2^26 scores: all three), GEMMs of 512 rows
    (a text's) and 4,096 (a video's: the model's own layers run thousands of rows), elementwise passes over 4,096
    tokens: LayerNorm, RMSNorm, the modulation's addcmul, the GELU and a residual add."""
    assert calibrate.TOKENS == (1024, 2048, 4096) and calibrate.HEADS == 8 and calibrate.GEMM_ROWS == (512, 4096)
    assert calibrate.MATH_MAX_SCORES == 1 << 26 and calibrate.ELEMENTWISE_ROWS == 4096
    assert calibrate.ELEMENTWISE_OPS == ("layer_norm", "rms_norm", "addcmul", "gelu", "add")


def test_the_elementwise_passes_are_the_models_ops_with_their_traffic():
    """Each timed pass is the torch op a block runs (LayerNorm without affine, RMSNorm with its weight, addcmul
    with a broadcast row, the tanh GELU, an add), counted with the elements it reads plus writes."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    scale, weight = torch.randn(1, 16, generator=g), torch.randn(16, generator=g)
    ops = calibrate.elementwise_ops(torch, x, y, scale, weight)
    assert list(ops) == list(calibrate.ELEMENTWISE_OPS)
    assert {k: units for k, (units, _) in ops.items()} == {"layer_norm": 2, "rms_norm": 2, "addcmul": 3, "gelu": 2,
                                                          "add": 3}
    F = torch.nn.functional
    want = {"layer_norm": F.layer_norm(x, (16,), eps=1e-6), "rms_norm": F.rms_norm(x, (16,), weight, eps=1e-6),
            "addcmul": x + y * scale, "gelu": F.gelu(x, approximate="tanh"), "add": x + y}
    for name, (_, fn) in ops.items():
        torch.testing.assert_close(fn(), want[name])


# --------------------------------------------------------------------------------------------- the command
@pytest.fixture
def fake_measure(monkeypatch):
    calls = []

    def measure(device, dtype, model, comfyui=None, monitor=None):
        calls.append((device, dtype, model, comfyui))
        if monitor is not None:  # one figure timed under the monitor, as measure() times each (quiet: conftest)
            with monitor.span(("pack", 1024)):
                pass
        return {"version": 2, "device": "Test CPU (x86_64)", "dtype": dtype, "model": model,
                "date": "2026-12-01 12:00 UTC",
                "attention": {"pack": [{"tokens": 1024, "gflops": 12.34}, {"tokens": 2048, "gflops": 5.0}],
                              "math": [{"tokens": 1024, "gflops": 0.06}]},
                "gemm": [{"m": 512, "k": 3072, "n": 3072, "gflops": 150.0},
                         {"m": 512, "k": 3072, "n": 14336, "gflops": 99.95}]}
    monkeypatch.setattr(calibrate, "measure", measure)
    return calls


def test_cli_defaults_and_output(profdir, monkeypatch, capsys, fake_measure):
    """Defaults: the CPU in fp32, Wan 2.2 5B's shapes, the ComfyUI ./dev set up, the file in the profile folder.
    Output: where it went, then one line of rates per attention kind and one for the GEMMs (GFLOP/s, one
    decimal); without ComfyUI, a note that sub-quadratic was not measured and how to get it."""
    monkeypatch.setattr(bench, "default_comfyui", lambda: None)
    monkeypatch.setattr(profiles, "_device_name", lambda device: ("Test CPU", "x86_64"))
    assert calibrate.main([]) == 0
    assert fake_measure == [("cpu", "fp32", "wan22-5b", None)]
    path = str(profdir / "calibration-test-cpu-x86-64-fp32.json")
    assert capsys.readouterr().out.split("\n") == [
        f"calibration of Test CPU (x86_64), fp32, 2026-12-01 12:00 UTC -> {path}",
        "  attention pack     N 1024: 12.3 (others 0.0), N 2048: 5.0 GFLOP/s",
        "  attention math     N 1024: 0.1 GFLOP/s (math SDPA: sdpa_kernel(SDPBackend.MATH))",
        "  GEMM               512x3072x3072: 150.0, 512x3072x14336: 100.0 GFLOP/s",
        "  (ComfyUI not found: sub-quadratic not measured; pass --comfyui PATH)",
        f"  measured at: other processes' runnable threads 0.00 on average (max 0, 1 readings) on {os.cpu_count()} "
        "cores; busy above " + format(os.cpu_count() / 4, "g"),
        ""]
    assert calibration.load(path)["model"] == "wan22-5b"


def test_cli_flags(tmp_path, monkeypatch, capsys, fake_measure):
    """--comfyui, --model, --dtype and --out are passed through; with ComfyUI there is no note; a GPU device
    measures fp16 by default."""
    comfy = tmp_path / "comfy-root"
    (comfy / "comfy").mkdir(parents=True)
    (comfy / "comfy" / "model_management.py").write_text("")
    monkeypatch.setattr(bench, "default_comfyui", lambda: "/default/comfy")
    out = str(tmp_path / "c.json")
    assert calibrate.main(["--model", "ltx23-22b", "--dtype", "bf16", "--comfyui", str(comfy), "--out", out]) == 0
    assert fake_measure[-1] == ("cpu", "bf16", "ltx23-22b", str(comfy))
    text = capsys.readouterr().out
    assert text.startswith(f"calibration of Test CPU (x86_64), bf16, 2026-12-01 12:00 UTC -> {out}\n")
    assert "ComfyUI not found" not in text and calibration.load(out)["dtype"] == "bf16"
    assert calibrate.main(["--out", out]) == 0
    assert fake_measure[-1] == ("cpu", "fp32", "wan22-5b", "/default/comfy")
    monkeypatch.setattr(cli_args, "device", lambda s: s)  # accept a GPU name without a GPU
    assert calibrate.main(["--device", "cuda:1", "--out", out]) == 0
    assert fake_measure[-1][:2] == ("cuda:1", "fp16")


@pytest.mark.parametrize("args, message", [
    (["--dtype", "fp64"], "error: argument --dtype: invalid choice: 'fp64' (choose from 'fp16', 'bf16', 'fp32')"),
    (["--model", "sdxl"], "error: argument --model: invalid choice: 'sdxl' (choose from 'ltx23-22b', 'wan-14b', "
                          "'wan22-5b', 'z-image-turbo')"),
    (["--comfyui", "/nonexistent"], "error: argument --comfyui: expected a ComfyUI folder (one with "
                                    "comfy/model_management.py), got '/nonexistent'"),
    (["--device", "tpu"], "error: argument --device: unknown device 'tpu'; accepted: "),
])
def test_cli_refuses_bad_flags_in_one_line(capsys, fake_measure, args, message):
    with pytest.raises(SystemExit) as e:
        calibrate.main(args)
    assert e.value.code == 2 and not fake_measure
    assert capsys.readouterr().err.startswith(message)


@pytest.mark.parametrize("error", [RuntimeError, ValueError])
def test_cli_reports_a_failed_measurement_in_one_line(tmp_path, monkeypatch, capsys, error):
    """torch's errors for a device or dtype it cannot run (RuntimeError, ValueError): one line naming both, exit 2,
    no file written."""
    def measure(device, dtype, model, comfyui=None, monitor=None):
        raise error("out of luck")
    monkeypatch.setattr(calibrate, "measure", measure)
    monkeypatch.setattr(bench, "default_comfyui", lambda: None)
    assert calibrate.main(["--out", str(tmp_path / "c.json")]) == 2
    assert capsys.readouterr().err == "error: --device cpu --dtype fp32: out of luck\n"
    assert os.listdir(tmp_path) == []


def test_runs_as_a_module_with_its_help(monkeypatch, capsys):
    """`python -m attention_core.calibrate --help` (what the plan tells the user to run; run in this process):
    the module doc's first paragraph as the description, the flags with their defaults."""
    import runpy
    import sys
    import warnings
    monkeypatch.setattr(sys, "argv", ["calibrate", "--help"])
    # imported, attention_core.calibrate is attention_core.cli.calibrate itself (sys.modules), whose loader runpy
    # will not run under the alias's name: run the alias file, as a fresh `python -m` does
    monkeypatch.delitem(sys.modules, "attention_core.calibrate", raising=False)
    with warnings.catch_warnings(), pytest.raises(SystemExit) as e:
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module is already imported
        runpy.run_module("attention_core.calibrate", run_name="__main__")
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert text.startswith("usage: python -m attention_core.calibrate [-h] [--version] [--device DEVICE] [--dtype {fp16,bf16,fp32}] "
                           "[--model {ltx23-22b,wan-14b,wan22-5b,z-image-turbo}] [--comfyui COMFYUI] [--out OUT] ")
    assert ("Device calibration: measured throughput of what a DiT sampling step does, for attention_core.estimate."
            in text)
    assert "dtype to measure (default: fp32 on the CPU, fp16 on a GPU)" in text


def test_version_is_a_json_number(tmp_path):
    """JSON has one number type: a file whose version another tool wrote as 2.0 is version 2, 1.0 is version 1
    (read upgraded), and 3.0 is neither."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps(_calib()).replace('"version": 2', '"version": 2.0'))
    assert calibration.load(str(path))["version"] == 2 and "upgraded_from" not in calibration.load(str(path))
    path.write_text(json.dumps(_calib()).replace('"version": 2', '"version": 1.0'))
    assert calibration.load(str(path))["upgraded_from"] == 1
    assert calibration.validate({**_calib(), "version": 3.0}) == "version 3.0 is not 1 or 2"


# ------------------------------------------------------------------------- an output that cannot be written
def _refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        calibrate.main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err, (out, err)
    return err.rstrip("\n")


def test_an_output_that_cannot_be_written_is_refused_before_measuring(profdir, monkeypatch, capsys, fake_measure,
                                                                       unwritable_folder):
    """Issue 22.6: a file where the folder should be, or a folder nothing can be created in (tried, not read
    from the permission bits: root passes those), whether --out names it or it is the default profile folder:
    one error line, exit 2, before a minute of measuring; nothing is written."""
    monkeypatch.setattr(bench, "default_comfyui", lambda: None)
    monkeypatch.setattr(profiles, "_device_name", lambda device: ("Test CPU", "x86_64"))
    blocker = profdir / "file"
    blocker.write_text("a file, not a folder")
    ro = unwritable_folder(profdir / "read-only")
    assert _refused(["--out", str(blocker / "c.json")], capsys) == (
        f"error: argument --out: {str(blocker)!r} is a file, not a folder; expected a file path in an existing folder")
    assert _refused(["--out", str(blocker / "deeper" / "c.json")], capsys).startswith(
        f"error: argument --out: {str(blocker)!r} is a file, not a folder")
    assert _refused(["--out", str(ro / "c.json")], capsys).startswith(
        f"error: argument --out: folder {str(ro)!r} is not writable")
    for folder, why in [(blocker / "profiles", f"{str(blocker)!r} is a file, not a folder"),
                        (ro, f"folder {str(ro)!r} is not writable"),
                        (ro / "new", f"folder {str(ro)!r} is not writable")]:  # a folder that cannot be made
        monkeypatch.setenv(profiles.ENV_DIR, str(folder))
        path = calibration.calibration_path("cpu", "fp32")
        assert path == str(folder / "calibration-test-cpu-x86-64-fp32.json")
        err = _refused([], capsys)
        assert err.startswith(f"error: argument --out: cannot write the default calibration file {path!r}: {why}"), err
        assert err.endswith("; pass --out FILE (or set TILED_ATTENTION_PROFILE_DIR)")
    assert fake_measure == []  # nothing measured
    assert sorted(os.listdir(profdir)) == ["file", "read-only"] and os.listdir(ro) == []
    # a default folder that does not exist yet but can be made is fine: it is made when the file is saved
    monkeypatch.setenv(profiles.ENV_DIR, str(profdir / "new" / "deeper"))
    assert calibrate.main([]) == 0 and len(fake_measure) == 1
    assert calibration.load(str(profdir / "new" / "deeper" / "calibration-test-cpu-x86-64-fp32.json"))


def test_a_write_that_fails_after_measuring_keeps_the_calibration(tmp_path, monkeypatch, capsys, fake_measure):
    """Checked up front, the write can still fail later (the folder removed, the disk full): the rates are
    printed, the calibration goes to a temporary file named in one error line, exit 2, no traceback."""
    import errno
    import tempfile

    def full(data, path):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(calibrate, "save", full)
    monkeypatch.setattr(bench, "default_comfyui", lambda: None)
    kept_dir = tmp_path / "tmp"
    kept_dir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(kept_dir))
    out = str(tmp_path / "c.json")
    assert calibrate.main(["--out", out]) == 2
    text, err = capsys.readouterr()
    (kept,) = kept_dir.iterdir()
    assert err == f"error: could not write {out!r} (No space left on device); the calibration is in " \
                  f"{str(kept)!r}: copy it there\n"
    assert kept.name.startswith("c-") and kept.name.endswith(".json")
    saved = json.loads(kept.read_text())
    assert saved["attention"]["pack"][0]["gflops"] == 12.34 and "load" in saved and calibration.validate(saved) is None
    assert "-> not saved" in text and "N 1024: 12.3" in text  # the rates are printed too


def test_cli_prints_the_elementwise_rate(tmp_path, monkeypatch, capsys):
    """With an elementwise measurement, one line of GB/s after the GEMMs, with its load."""
    def measure(device, dtype, model, comfyui=None, monitor=None):
        with monitor.span(("elementwise", 4096)):
            pass
        return {"version": 2, "device": "Test CPU (x86_64)", "dtype": dtype, "model": model, "date": "today",
                "attention": {"pack": [{"tokens": 1024, "gflops": 1.0}]},
                "gemm": [{"m": 4096, "k": 3072, "n": 3072, "gflops": 150.0}],
                "elementwise": [{"rows": 4096, "width": 3072, "gbps": 12.345}]}
    monkeypatch.setattr(calibrate, "measure", measure)
    monkeypatch.setattr(bench, "default_comfyui", lambda: "/comfy")
    assert calibrate.main(["--out", str(tmp_path / "c.json")]) == 0
    lines = capsys.readouterr().out.split("\n")
    assert lines[2:4] == ["  GEMM               4096x3072x3072: 150.0 GFLOP/s",
                          "  elementwise        4096x3072: 12.3 (others 0.0) GB/s"]

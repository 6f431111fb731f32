"""attention_core.tune: where profiles live, what tuned_blocks returns (rescaling, budget, switches), that a
tuned tile computes exactly torch's attention, and one real tuning pass on a tiny shape."""
import json
import os
import re
import sys

import pytest
import torch

from attention_core.cli import cli_args, tune
from attention_core.device import profiles
from reference import math_sdpa


def entry(**kw):
    e = {"tier": "chunked", "dtype": "float32", "heads": 24, "dim": 128, "n": 4096, "rows_timed": 512,
         "block_q": 128, "block_kv": 4096, "heads_per_group": 4, "ms": 1.0, "untuned_ms": 2.0, "use": True}
    e.update(kw)
    return e


def write(entries):
    prof = {"version": profiles.PROFILE_VERSION, "device": "x", "arch": "y", "torch": torch.__version__,
            "entries": entries}
    return profiles.save_profile(prof, "cpu")


def test_profile_path_keyed_by_device_and_torch(profdir):
    path = profiles.profile_path("cpu")
    assert os.path.dirname(path) == str(profdir)
    name, arch = profiles._device_name("cpu")
    assert torch.__version__.replace(".", "-").replace("+", "-").lower() in os.path.basename(path)
    assert arch.lower().replace("_", "-") in os.path.basename(path)


def test_profile_dir_default_is_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delitem(sys.modules, "folder_paths", raising=False)
    monkeypatch.delenv(profiles.ENV_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert profiles.profile_dir() == os.path.join(str(tmp_path), "tiled-attention")


def test_profile_dir_inside_comfyui_is_its_user_directory(monkeypatch):
    from comfy_harness import require_comfy
    require_comfy()
    import folder_paths
    monkeypatch.setitem(sys.modules, "folder_paths", folder_paths)
    assert profiles.profile_dir() == os.path.join(folder_paths.get_user_directory(), "tiled-attention")


def test_no_profile_no_blocks(profdir):
    assert profiles.tuned_blocks("cpu", torch.float32, 24, 4096, 4096, 128, "chunked", 1 << 30) is None


def test_tuned_blocks_from_the_profile(profdir, monkeypatch):
    write([entry(), entry(tier="online", block_q=256, block_kv=1024, heads_per_group=24),
           entry(dtype="bfloat16", block_q=64, use=False)])
    assert profiles.tuned_blocks("cpu", torch.float32, 24, 4096, 4096, 128, "chunked", 1 << 30) == (128, 4096, 4)
    # twice the keys: half the rows, the tile keeps its tuned number of scores
    assert profiles.tuned_blocks("cpu", torch.float32, 24, 8192, 8192, 128, "chunked", 1 << 30) == (64, 8192, 4)
    # online: block sizes as tuned; "all heads" stays all heads of the call
    assert profiles.tuned_blocks("cpu", torch.float32, 32, 4096, 4096, 128, "online", 1 << 30) == (256, 1024, 32)
    # over the budget: 4 bytes (the CPU's chunked tile: P overwrites S) x 128 x 4096 x 4 heads = 8 MB > 8 MB - 1
    assert profiles.tuned_blocks("cpu", torch.float32, 24, 4096, 4096, 128, "chunked", 8 << 20) == (128, 4096, 4)
    assert profiles.tuned_blocks("cpu", torch.float32, 24, 4096, 4096, 128, "chunked", (8 << 20) - 1) is None
    # a shape where the engine's own plan won, another head dim, the switch off: no tuned tile
    assert profiles.tuned_blocks("cpu", torch.bfloat16, 24, 4096, 4096, 128, "chunked", 1 << 30) is None
    assert profiles.tuned_blocks("cpu", torch.float32, 24, 4096, 4096, 64, "chunked", 1 << 30) is None
    # a key or head count more than 2x from every tuned one: the engine's own plan
    assert profiles.tuned_blocks("cpu", torch.float32, 24, 1024, 1024, 128, "chunked", 1 << 30) is None
    assert profiles.tuned_blocks("cpu", torch.float32, 4, 4096, 4096, 128, "chunked", 1 << 30) is None
    monkeypatch.setenv(profiles.ENV_SWITCH, "off")
    assert profiles.tuned_blocks("cpu", torch.float32, 24, 4096, 4096, 128, "chunked", 1 << 30) is None


def test_profile_reread_when_it_changes(profdir):
    write([entry()])
    assert profiles.tuned_blocks("cpu", torch.float32, 24, 4096, 4096, 128, "chunked", 1 << 30)[0] == 128
    path = write([entry(block_q=32)])
    os.utime(path, (1, 1))  # a different mtime even within the file system's resolution
    assert profiles.tuned_blocks("cpu", torch.float32, 24, 4096, 4096, 128, "chunked", 1 << 30)[0] == 32


@pytest.mark.parametrize("blocks", [(16, 200, 1), (32, 200, 3), (64, 200, 6), (16, 100, 4)])
def test_run_blocks_is_torch_attention(blocks):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 6, 200, 32, generator=g) for _ in range(3))
    ref = math_sdpa(q.double(), k.double(), v.double())
    out = tune.run_blocks(q, k, v, blocks)
    assert (out.double() - ref).abs().max() < 1e-5


def test_a_real_tuning_pass_saves_a_profile_the_planner_reads(profdir):
    prof = tune.tune("cpu", ["float32"], [(4, 256, 32)], ["chunked"], rows=64, repeats=1, log=lambda s: None)
    (e,) = prof["entries"]
    assert (e["heads"], e["n"], e["dim"], e["tier"]) == (4, 256, 32, "chunked")
    assert e["block_kv"] == 256 and 4 % e["heads_per_group"] == 0 and e["ms"] > 0 and e["untuned_ms"] > 0
    path = profiles.save_profile(prof, "cpu")
    with open(path) as f:
        assert json.load(f)["entries"][0]["block_q"] == e["block_q"]
    got = profiles.tuned_blocks("cpu", torch.float32, 4, 256, 256, 32, "chunked", 1 << 30)
    assert got == (None if not e["use"] else (e["block_q"], 256, e["heads_per_group"]))


def test_auto_runs_the_profiles_tile_within_the_budget(profdir, monkeypatch):
    """The planner's hook: tier auto takes the profile's tile (here 32 rows, 2 of 4 heads a group), forced
    blocks or TILED_ATTENTION_TUNE=off or a budget the tile exceeds leave the engine's own plan."""
    from attention_core.kernel import driver
    from attention_core import scaled_dot_product_attention
    write([entry(heads=4, dim=32, n=256, block_q=32, block_kv=256, heads_per_group=2)])
    seen = []
    real = driver.TIERS["chunked"]

    def spy(src, block_q, block_kv, need_stats, **kw):
        seen.append((src.p.Hkv, block_q, block_kv))
        return real(src, block_q, block_kv, need_stats, **kw)
    monkeypatch.setitem(driver.TIERS, "chunked", spy)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 4, 256, 32, generator=g) for _ in range(3))
    ref = math_sdpa(q.double(), k.double(), v.double())

    out = scaled_dot_product_attention(q, k, v, memory_budget=1 << 30)
    assert seen == [(2, 32, 256), (2, 32, 256)]
    assert (out.double() - ref).abs().max() < 1e-5
    seen.clear()
    scaled_dot_product_attention(q, k, v, memory_budget=1 << 30, block_q=64)
    assert seen == [(4, 64, 256)]
    seen.clear()
    scaled_dot_product_attention(q, k, v, memory_budget=4 * 32 * 256 * 2 - 1)  # one byte short of the tile
    assert seen and all(s != (2, 32, 256) for s in seen)
    seen.clear()
    monkeypatch.setenv(profiles.ENV_SWITCH, "off")
    scaled_dot_product_attention(q, k, v, memory_budget=1 << 30)
    assert seen and all(s != (2, 32, 256) for s in seen)


# ------------------------------------------------------------------ profiles are untrusted input (issue 17.3/17.8)
def _write_raw(text):
    path = profiles.profile_path("cpu")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return path


def _small_problem(seed=3):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 4, 256, 32, generator=g) for _ in range(3))
    return q, k, v, math_sdpa(q.double(), k.double(), v.double())


@pytest.mark.parametrize("bad", [dict(tier="online", block_q=-5, block_kv=64), dict(tier="online", block_q=0),
                                 dict(tier="online", block_kv=0), dict(tier="online", block_kv=-64),
                                 dict(block_q=-128), dict(heads_per_group=-2), dict(heads_per_group=0)])
def test_a_zero_or_negative_tile_never_computes_garbage(profdir, caplog, bad):
    """The tuned tile of an online entry with block_q = -5 ran no query tile at all: the output was the
    uninitialised buffer (off by ~1e37); block sizes of 0 crashed. Such entries are dropped with one warning,
    and the call is torch's attention."""
    path = write([entry(heads=4, dim=32, n=256, **bad)])
    q, k, v, ref = _small_problem()
    from attention_core import scaled_dot_product_attention
    with caplog.at_level("WARNING"):
        for budget in (8 << 10, 1 << 30):  # 8 KB: only online tiles fit; 1 GB: the chunked tier
            out = scaled_dot_product_attention(q, k, v, memory_budget=budget)
            assert (out.double() - ref).abs().max() < 1e-5, (bad, budget)
    warned = [r for r in caplog.records if path in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("text", [
    "[1, 2, 3]", '"a string"', "null", "{}", '{"version": 1}', '{"version": 1, "entries": "abc"}',
    '{"version": 1, "entries": ["abc", 3, null]}', '{"version": "1", "entries": []}',
    '{"version": 1, "entries": [{"tier": "chunked"}]}',
    '{"version": 1, "entries": [{"tier": "chunked", "dtype": "float32", "heads": "4", "dim": 32, "n": 256,'
    ' "block_q": "32", "block_kv": 256, "heads_per_group": 2}]}',
    '{"version": 1, "entries": [{"tier": "chunked", "dtype": "float32", "heads": 4, "dim": 32, "n": 0,'
    ' "block_q": 32, "block_kv": 256, "heads_per_group": 2}]}',
    '{"version": 1, "entries": [{"tier": "chunked", "dtype": "float32", "heads": 0, "dim": 32, "n": 256,'
    ' "block_q": 32, "block_kv": 256, "heads_per_group": 2}]}',
    '{"version": 1, "entries": [{"tier": "chunked", "dtype": "float32", "heads": 4, "dim": 32, "n": 256,'
    ' "block_q": 32.5, "block_kv": 256, "heads_per_group": true}]}',
    '{"version": 1, "entries": [{"tier": "chunked", "dtype": "float32", "heads": 4, "dim": 32, "n": 1e400,'
    ' "block_q": 32, "block_kv": 256, "heads_per_group": 2}]}',
    '{"version": 1, "entries": [{"tier": "nope", "dtype": 7, "heads": 4, "dim": 32, "n": 256,'
    ' "block_q": 32, "block_kv": 256, "heads_per_group": 2, "layout": "diagonal"}]}',
    "{not json", ""])
def test_a_malformed_profile_warns_once_and_auto_still_works(profdir, caplog, text):
    """Valid JSON of the wrong types (a list, strings, missing keys, n = 0) crashed every `auto` call with
    AttributeError / TypeError / KeyError / a math domain error. Now: one warning naming the file, and every call
    is torch's attention (the engine's own tiles)."""
    path = _write_raw(text)
    q, k, v, ref = _small_problem()
    from attention_core import scaled_dot_product_attention
    with caplog.at_level("WARNING"):
        for budget in (8 << 10, 1 << 30, None):
            out = scaled_dot_product_attention(q, k, v, memory_budget=budget)
            assert (out.double() - ref).abs().max() < 1e-5
        assert profiles.lookup((1, 4, 256, 32), torch.float32) is None
    warned = [r for r in caplog.records if path in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]


def test_good_entries_of_a_partly_bad_profile_are_kept(profdir, caplog):
    good = entry(heads=4, dim=32, n=256, block_q=32, block_kv=256, heads_per_group=2)
    path = write([good, {"tier": "chunked"}, "x", entry(dim=64, block_q=-1)])
    with caplog.at_level("WARNING"):
        assert profiles.tuned_blocks("cpu", torch.float32, 4, 256, 256, 32, "chunked", 1 << 30) == (32, 256, 2)
        assert profiles.tuned_blocks("cpu", torch.float32, 24, 4096, 4096, 64, "chunked", 1 << 30) is None
    warned = [r.getMessage() for r in caplog.records if path in r.getMessage()]
    assert len(warned) == 1 and "3 of 4" in warned[0], warned


@pytest.mark.parametrize("tier", ["chunked", "online"])
def test_tiles_stay_within_1_and_n_at_the_point_of_use(profdir, monkeypatch, tier):
    """Even an entry that skipped validation (handed over in memory) gives tiles within [1, N]."""
    bad = entry(tier=tier, heads=4, dim=32, n=256, block_q=-7, block_kv=10 ** 9, heads_per_group=-3)
    monkeypatch.setattr(profiles, "load_profile", lambda device="cpu": {"version": 1, "entries": [bad]})
    for lq, lk in ((256, 256), (1, 200), (300, 300)):
        got = profiles.tuned_blocks("cpu", torch.float32, 4, lq, lk, 32, tier, 1 << 40)
        if got is not None:
            bq, bkv, hpg = got
            assert 1 <= bq <= lq and 1 <= bkv <= lk and 1 <= hpg <= 4, (lq, lk, got)
        bq, bkv, hpg = profiles.tuned_blocks_for(bad, 4, lq, lk)
        assert 1 <= bq <= lq and 1 <= bkv <= lk and 1 <= hpg <= 4, (lq, lk)


_WRITER = r"""
import importlib.util, sys, time
# attention_core.device.jsonfile alone (what save_profile writes with), without importing torch: the writers start fast
spec = importlib.util.spec_from_file_location("jsonfile", sys.argv[1])
jsonfile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(jsonfile)
path, seed = sys.argv[2], int(sys.argv[4])
errors, n = 0, 0
deadline = time.time() + float(sys.argv[3])
while time.time() < deadline:
    prof = {"version": 1, "writer": seed, "entries": [
        {"tier": "chunked", "dtype": "float32", "heads": 4, "dim": 32, "n": 256, "block_q": 16 * (1 + (n + seed) % 8),
         "block_kv": 256, "heads_per_group": 2, "use": True, "pad": "x" * (1000 * (n % 50))}]}
    try:
        jsonfile.atomic_write_json(path, prof)
    except Exception as e:
        errors += 1
        if errors < 3:
            print(repr(e), file=sys.stderr)
    n += 1
print(errors, n)
"""


def test_concurrent_writers_never_collide_and_readers_always_see_a_valid_file(profdir):
    """Two processes saving at once shared one temporary name: hundreds of FileNotFoundError in seconds, and
    readers caught partial files. Four writer processes save for a second each (save_profile's writer,
    jsonfile.atomic_write_json) while this process keeps reading the file and loading the profile."""
    import subprocess
    from attention_core.device import jsonfile
    path = profiles.profile_path("cpu")
    write([entry()])
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, jsonfile.__file__, path, "1.0", str(i)],
                              stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(4)]
    reads, bad = 0, []
    while any(p.poll() is None for p in procs) or reads == 0:
        with open(path) as f:
            text = f.read()
        try:
            json.loads(text)
        except ValueError as e:
            bad.append(f"{e}: {text[:60]!r}")
        prof = profiles.load_profile("cpu")
        assert prof is not None and prof["entries"], "a reader saw no usable profile"
        reads += 1
    results = [p.communicate() for p in procs]
    for out, err in results:
        errors, saves = map(int, out.split())
        assert errors == 0 and saves > 0, err
    assert not bad, bad[:3]
    assert reads > 10
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]  # no temporary file left behind


def test_tune_keeps_the_smallest_tile_within_3_percent_of_the_fastest(profdir, monkeypatch):
    """Tile memory is what the engine adds, so a larger tile must buy measured speed (issue 18.5): with the largest
    candidate 2 % faster than the rest, the smallest candidate is kept; at 5 % the largest is. The engine's own tile
    (timed first) competes: when it is the smallest fast one, the entry says use = false."""
    ran = []
    monkeypatch.setattr(tune, "run_blocks", lambda q, k, v, blocks, tier="chunked": ran.append(tuple(blocks)))
    monkeypatch.setattr(tune, "scaled_dot_product_attention", lambda *a, **kw: ran.append("engine"))
    cands = tune.candidates("chunked", 4, 1024, 256)
    largest = max(cands, key=lambda c: c[0] * c[1] * c[2])
    smallest = min(cands, key=lambda c: c[0] * c[1] * c[2])

    def timing(slower, engine):
        def fake_time(fn, repeats, warm=True):
            fn()
            last = ran[-1]
            return engine if last == "engine" else (1.0 if last == largest else 1.0 + slower)
        return fake_time
    monkeypatch.setattr(tune, "_time", timing(0.02, engine=1.5))
    e = tune.tune_shape(4, 1024, 32, "float32", "cpu", "chunked", 256, 1, log=lambda s: None)
    assert (e["block_q"], e["block_kv"], e["heads_per_group"]) == smallest and e["use"]
    monkeypatch.setattr(tune, "_time", timing(0.05, engine=1.5))
    e = tune.tune_shape(4, 1024, 32, "float32", "cpu", "chunked", 256, 1, log=lambda s: None)
    assert (e["block_q"], e["block_kv"], e["heads_per_group"]) == largest and e["use"]
    monkeypatch.setattr(tune, "_time", timing(0.02, engine=0.97))  # the engine's own tile fastest by 3 %+
    assert not tune.tune_shape(4, 1024, 32, "float32", "cpu", "chunked", 256, 1, log=lambda s: None)["use"]


@pytest.mark.parametrize("keys_major", [False, True])
def test_both_score_layouts_of_the_layout_check_are_torch_attention(keys_major):
    """The layout check (tune --layouts, issue 18.4) times two exact computations: queries-major S = Q K^T and
    keys-major S^T = K Q^T with the softmax over keys on dim -2 both equal torch's math SDPA in float64."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 3, 100, 16, generator=g, dtype=torch.float64) for _ in range(3))
    ref = math_sdpa(q, k, v)
    out = tune._chunked_loop(q * 16 ** -0.5, k, v, 32, keys_major)
    assert (out - ref).abs().max() < 1e-12


def test_layout_check_alternates_which_layout_runs_first(monkeypatch):
    """Interleaved rounds cancel drift (clocks ramping, a cache warming) only if each layout goes first in every
    other round: after the two exactness runs, rounds run queries-major then keys-major, then the other way."""
    order = []
    real = tune._chunked_loop

    def spy(q, k, v, bq, keys_major):
        order.append(keys_major)
        return real(q, k, v, bq, keys_major)
    monkeypatch.setattr(tune, "_chunked_loop", spy)
    clock = iter(range(1000))  # perf_counter: 1 s a call, so every run takes 1 s ...
    monkeypatch.setattr(tune.time, "perf_counter", lambda: float(next(clock)))
    lines = []
    r = tune.layout_check(2, 64, 16, "float32", "cpu", 32, 5, log=lines.append)
    assert order == [False, True] + [False, True, True, False] * 2 + [False, True]
    assert r["queries_major_ms"] == r["keys_major_ms"] == 1000.0
    assert "queries-major 1000.0 ms, keys-major 1000.0 ms (keys-major 1.00x as fast" in lines[0], lines


def test_layout_check_reports_the_medians_and_their_ratio(monkeypatch):
    """Each layout's time is the median of its rounds; the line says how many times as fast keys-major is."""
    runs = iter([0.3, 0.1, 0.2, 0.1, 0.1, 0.9, 0.2, 0.1])  # queries-major 0.3, 0.2, 0.1 s; keys-major 0.1, 0.9, ...
    state = {"t": 0.0, "start": True}

    def clock():
        if not state["start"]:
            state["t"] += next(runs)
        state["start"] = not state["start"]
        return state["t"]
    monkeypatch.setattr(tune, "_chunked_loop", lambda q, k, v, bq, keys_major: q.new_zeros(1))
    monkeypatch.setattr(tune.time, "perf_counter", clock)
    lines = []
    r = tune.layout_check(2, 64, 16, "float32", "cpu", 32, 4, log=lines.append)
    # rounds: (qm, km) = (0.3, 0.1), (km, qm) = (0.2, 0.1), (qm, km) = (0.1, 0.9), (km, qm) = (0.2, 0.1)
    assert r == {"heads": 2, "n": 64, "dim": 16, "dtype": "float32", "block_q": 32, "heads_per_group": 2,
                 "queries_major_ms": pytest.approx(100.0), "keys_major_ms": pytest.approx(200.0)}
    assert lines == ["  layout 2x16 N=64 float32, tile 32 rows x 2 heads, 32 rows, 4 rounds: queries-major 100.0 ms, "
                     "keys-major 200.0 ms (keys-major 0.50x as fast; per round [3.0, 0.5, 0.11, 0.5]; "
                     "max |diff| 0.0e+00)"]


def test_layout_check_cli_prints_both_layouts(capsys):
    assert tune.main(["--layouts", "2", "--presets", "reference", "--max-n", "512", "--rows", "64"]) == 0
    out = capsys.readouterr().out
    assert "queries-major" in out and "keys-major" in out and "max |diff|" in out


def test_a_profile_and_calibration_saved_from_a_shell_are_found_inside_comfyui(profdir, tmp_path, monkeypatch):
    """tune / calibrate run from a shell write to the per-user folder; inside ComfyUI (folder_paths loaded) the
    user directory is read first, then that folder, so the shell's files are used; a file in the user directory
    takes precedence, and what ComfyUI saves goes to its user directory."""
    import types
    from attention_core.device import calibration
    shell_saved = write([entry()])
    cal_name = os.path.basename(calibration.calibration_path("cpu", "fp32"))
    cal_shell = os.path.join(str(profdir), cal_name)
    with open(cal_shell, "w") as f:
        f.write("{}")
    user = tmp_path / "comfy-user"
    monkeypatch.setitem(sys.modules, "folder_paths",
                        types.SimpleNamespace(get_user_directory=lambda: str(user)))
    profiles._cache.clear()
    assert profiles.profile_path("cpu") == shell_saved
    assert profiles.load_profile("cpu") is not None
    assert calibration.calibration_path("cpu", "fp32") == cal_shell
    in_comfy = write([entry(block_q=64)])
    assert os.path.dirname(in_comfy) == str(user / "tiled-attention")
    assert profiles.profile_path("cpu") == in_comfy
    assert profiles.load_profile("cpu")["entries"][0]["block_q"] == 64


def test_a_shape_whose_every_candidate_fails_is_skipped_not_fatal(profdir, monkeypatch, capsys):
    """Every candidate out of memory (simulated) on one shape: the run goes on, that shape is logged as skipped;
    nothing tuned at all: one error line, exit 1, no profile written."""
    real = tune.run_blocks

    def oom_for_8_heads(q, k, v, blocks, tier="chunked"):
        if q.shape[1] == 8:
            raise torch.OutOfMemoryError("simulated")
        return real(q, k, v, blocks, tier)
    monkeypatch.setattr(tune, "run_blocks", oom_for_8_heads)
    lines = []
    prof = tune.tune("cpu", ["float32"], [(8, 512, 64), (2, 512, 64)], ["chunked"], 64, 1, log=lines.append)
    assert [e["heads"] for e in prof["entries"]] == [2]
    assert any(ln.startswith("  skipped: no tile candidate ran") for ln in lines)
    monkeypatch.setattr(tune, "run_blocks", lambda *a, **k: (_ for _ in ()).throw(torch.OutOfMemoryError("x")))
    assert tune.main(["--presets", "reference", "--max-n", "512", "--rows", "64", "--repeats", "1",
                      "--dtype", "float32", "--device", "cpu"]) == 1
    assert "error: no shape could be tuned" in capsys.readouterr().err
    assert not os.path.exists(profiles.profile_path("cpu"))


def test_a_candidate_that_fails_for_another_reason_than_memory_stops_the_run(profdir, monkeypatch):
    """Only out of memory makes a tile candidate lose quietly (torch.OutOfMemoryError, a host MemoryError, a ROCm
    RuntimeError saying so); any other error is a bug in the engine and must not be hidden by tuning around it."""
    def broken(q, k, v, blocks, tier="chunked"):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    monkeypatch.setattr(tune, "run_blocks", broken)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        tune.tune("cpu", ["float32"], [(2, 512, 64)], ["chunked"], 64, 1, log=lambda s: None)
    monkeypatch.setattr(tune, "run_blocks", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("HIP out of memory. Tried to allocate 2.00 GiB")))
    lines = []
    prof = tune.tune("cpu", ["float32"], [(2, 512, 64)], ["chunked"], 64, 1, log=lines.append)
    assert prof["entries"] == [] and any("(out of memory)" in ln for ln in lines)


@pytest.mark.parametrize("error,kept", [(MemoryError(), True), (ValueError("a bug"), False)])
def test_the_layout_check_out_of_memory_keeps_the_default_layout_and_a_bug_is_raised(error, kept, profdir,
                                                                                    monkeypatch):
    def failing(*a, **k):
        raise error
    monkeypatch.setattr(tune, "layout_check", failing)
    lines = []
    if kept:
        prof = tune.tune("cpu", ["float32"], [(2, 512, 64)], ["chunked"], 64, 1, log=lines.append)
        assert "layouts" not in prof and any("score layouts not compared" in ln for ln in lines)
        assert len(prof["entries"]) == 1
    else:
        with pytest.raises(ValueError, match="a bug"):
            tune.tune("cpu", ["float32"], [(2, 512, 64)], ["chunked"], 64, 1, log=lines.append)


def as_typed(name: str) -> str:
    """`name` as the command line hands it over (split out of --tiers): an equal string that is not the interned
    literal, so identity tests (`is "online"`) cannot pass for equality."""
    typed = "".join(list(name))
    assert typed == name and typed is not name
    return typed


@pytest.mark.parametrize("tier", ["chunked", "inplace", "online"])
@pytest.mark.parametrize("budget", [None, 40 * 2 ** 20, 480 * 2 ** 10, 48 * 2 ** 10])
def test_the_engine_tile_tune_compares_against_is_the_one_the_engine_plans(tier, budget, monkeypatch):
    """tune times the engine's own tile beside the candidates; it must be the tile the engine's planner
    (memory.plan_forward) really takes for those rows at that budget, every tier (only online may shrink its key
    block to fit; with no tile fitting, the fallback is the whole shape). 480 KB: chunked and in-place do not fit
    8,192 keys, online does with a smaller key block; 48 KB: online only after halving its 1,024-key block."""
    from attention_core.kernel.memory import plan_forward, tile_budget
    from attention_core.kernel.numerics import choose_numerics
    from attention_core.kernel.problem import normalize
    heads, n, rows, dim = 4, 8192, 512, 64
    if budget is not None:
        monkeypatch.setattr(tune, "tile_budget", lambda device: budget)
    q, k = torch.zeros(1, heads, rows, dim), torch.zeros(1, heads, n, dim)
    p = normalize(q, k, k)
    plan = plan_forward(p, choose_numerics(p.dtype, p.device), tier,
                        budget if budget is not None else tile_budget(p.device))
    got = tune.engine_tile(heads, n, rows, "float32", "cpu", as_typed(tier), dim)
    want = (plan.block_q, plan.block_kv, plan.block_h) if plan is not None else (rows, n, heads)
    assert got == want
    if budget is not None and budget <= 480 * 2 ** 10:
        assert (plan is None) == (tier != "online") and (tier != "online" or plan.block_kv < 4096)
    if budget == 48 * 2 ** 10 and tier == "online":  # 16 rows x 1,024 keys x 4 bytes do not fit: 512 keys do
        assert plan.block_kv == 512


def test_online_candidates_try_every_key_block_up_to_n():
    """Online tiles sweep key blocks 512..4096 that are not longer than the keys; the other tiers take all keys."""
    for n in (512, 2048, 8192):
        kv = sorted({c[1] for c in tune.candidates(as_typed("online"), 4, n, 512)})
        assert kv == [b for b in (512, 1024, 2048, 4096) if b <= n], (n, kv)
        assert {c[1] for c in tune.candidates("chunked", 4, n, 512)} == {n}


# ------------------------------------------------------------------ what tune prints and keeps, with its numbers
def _fake_timings(monkeypatch, seconds, engine):
    """run_blocks / the untuned call record what ran; _time answers `seconds[tile]` or `engine` for it."""
    ran = []
    monkeypatch.setattr(tune, "run_blocks", lambda q, k, v, blocks, tier="chunked": ran.append(tuple(blocks)))
    monkeypatch.setattr(tune, "scaled_dot_product_attention", lambda q, *a, **kw: ran.append(("engine", q.shape)))

    def fake_time(fn, repeats, warm=True):
        fn()
        return engine if ran[-1][0] == "engine" else seconds[ran[-1]]
    monkeypatch.setattr(tune, "_time", fake_time)
    return ran


# 4 heads, 1,024 keys, 256 rows: six chunked candidates; the engine's own tile is (256, 1024, 4): all 256 rows
SIX = {(64, 1024, 2): 1.3, (128, 1024, 2): 1.02, (256, 1024, 2): 1.2,
       (64, 1024, 4): 1.4, (128, 1024, 4): 1.1, (256, 1024, 4): 1.0}


def test_tune_shape_logs_every_candidate_and_a_summary_with_the_fastest_and_the_kept_tile(monkeypatch):
    """The lines a user reads while tuning: the engine's own plan, each candidate's median in ms, then one summary
    with the untuned tile and time, the fastest time of all, and the kept tile (the smallest within 3 %: here
    (128, 1024, 2) at 1,020 ms, not the fastest (256, 1024, 4) at 1,000 ms); the entry holds the same figures."""
    _fake_timings(monkeypatch, SIX, engine=1.5)
    lines = []
    e = tune.tune_shape(4, 1024, 32, "float32", "cpu", "chunked", 256, 1, log=lines.append)
    assert lines[0] == "    engine's own plan:                    1500.0 ms"
    assert lines[1] == "    block_q   64 x keys  1024 x  2 heads:   1300.0 ms"
    assert lines[2] == "    block_q  128 x keys  1024 x  2 heads:   1020.0 ms"
    assert lines[6] == "    block_q  256 x keys  1024 x  4 heads:   1000.0 ms"
    assert lines[7] == ("  chunked  4x32 N=1024 float32: untuned (256, 1024, 4) 1500 ms, fastest 1000 ms, kept "
                        "(128, 1024, 2) 1020 ms on 256 rows (smallest within 3 % of the fastest)")
    assert len(lines) == 8
    assert e == {"tier": "chunked", "dtype": "float32", "heads": 4, "dim": 32, "n": 1024, "rows_timed": 256,
                 "block_q": 128, "block_kv": 1024, "heads_per_group": 2, "ms": pytest.approx(1020.0),
                 "untuned_ms": pytest.approx(1500.0), "fastest_ms": pytest.approx(1000.0), "use": True}


def test_tune_shape_says_when_the_engines_own_tile_is_as_good(monkeypatch):
    """The engine's own plan fastest (900 ms, more than 3 % ahead of every candidate): the summary's fastest is
    its time, the entry keeps the best candidate but with use = false, and the line says it is not used."""
    _fake_timings(monkeypatch, SIX, engine=0.9)
    lines = []
    e = tune.tune_shape(4, 1024, 32, "float32", "cpu", "chunked", 256, 1, log=lines.append)
    assert lines[-1] == ("  chunked  4x32 N=1024 float32: untuned (256, 1024, 4) 900 ms, fastest 900 ms, kept "
                         "(128, 1024, 2) 1020 ms on 256 rows (smallest within 3 % of the fastest); the engine own "
                         "tile is as good: not used")
    assert e["fastest_ms"] == pytest.approx(900.0) and e["ms"] == pytest.approx(1020.0) and e["use"] is False


def test_tune_shape_times_at_most_n_rows(monkeypatch):
    """--rows above the key count: the query rows timed (and said) are the keys' count, N."""
    ran = _fake_timings(monkeypatch, {c: 1.0 for c in tune.candidates("chunked", 2, 512, 512)}, engine=2.0)
    lines = []
    e = tune.tune_shape(2, 512, 16, "float32", "cpu", "chunked", 4096, 1, log=lines.append)
    assert ran[0] == ("engine", torch.Size([1, 2, 512, 16]))
    assert e["rows_timed"] == 512 and " on 512 rows " in lines[-1]
    assert {c[0] for c in ran[1:]} == {64, 128, 256, 512}


def test_candidates_are_the_documented_grid_with_inclusive_bounds():
    """Head groups of 2, 4, 8 or all heads (divisors only), rows 64..512 not above --rows, tiles of 2^16 to 2^24
    scores, both bounds included."""
    assert tune.candidates("chunked", 2, 512, 64) == [(64, 512, 2)]  # 2 x 64 x 512 = 2^16 exactly
    assert tune.candidates("chunked", 2, 511, 64) == []  # one score short of 2^16
    assert tune.candidates("chunked", 3, 1024, 64) == [(64, 1024, 3)]  # 2 does not divide 3 heads
    assert tune.candidates("chunked", 6, 1024, 100) == [(64, 1024, 2), (64, 1024, 6)]  # 128 rows > --rows 100
    c8 = tune.candidates("chunked", 8, 4096, 512)
    assert (512, 4096, 8) in c8 and len(c8) == 12  # 8 x 512 x 4096 = 2^24 exactly: still a candidate
    c16 = tune.candidates("chunked", 16, 4096, 512)
    assert (512, 4096, 16) not in c16 and (256, 4096, 16) in c16  # 2^25 scores: too large
    assert {c[2] for c in tune.candidates("inplace", 24, 1024, 512)} == {2, 4, 8, 24}
    assert tune.candidates("online", 2, 512, 64) == [(64, 512, 2)]


def test_choose_keeps_the_smallest_within_the_tolerance_and_the_faster_of_equal_sizes():
    t = {(128, 1024, 2): 103.0, (256, 1024, 4): 100.0}
    assert tune.choose(list(t.items())) == ((128, 1024, 2), 103.0)  # exactly 3 % slower still counts as fast
    t[(128, 1024, 2)] = 103.01
    assert tune.choose(list(t.items())) == ((256, 1024, 4), 100.0)
    # the same number of scores: the faster
    assert tune.choose([((64, 1024, 4), 101.0), ((128, 1024, 2), 100.5), ((256, 1024, 4), 100.0)]) == \
        ((128, 1024, 2), 100.5)


def test_time_is_the_median_of_the_repeats_after_one_warm_up_call(monkeypatch):
    calls = []
    clock = iter([0.0, 5.0, 10.0, 11.0, 20.0, 23.0])  # runs of 5, 1 and 3 s
    monkeypatch.setattr(tune.time, "perf_counter", lambda: next(clock))
    assert tune._time(lambda: calls.append(1), 3) == 3.0 and len(calls) == 4
    calls.clear()
    clock = iter([0.0, 2.0, 10.0, 14.0])
    assert tune._time(lambda: calls.append(1), 2, warm=False) == 3.0 and len(calls) == 2


def test_tune_cli_defaults(monkeypatch, capsys, profdir):
    """Without flags: the default presets (Wan 2.2 5B 480p, LTX 2.3 22B 720p, the reference lengths) with N capped
    at --max-n 8,192 (LTX's 14,960 keys become 8,192), the chunked tier, 1,024 rows, 2 repeats, float32 on the
    CPU; the first line says what is tuned. A run that tunes nothing: the error line, exit 1."""
    monkeypatch.setattr(cli_args, "default_device", lambda: "cpu")
    seen = []
    monkeypatch.setattr(tune, "tune", lambda *a, **kw: seen.append(a) or {"entries": []})
    assert tune.main([]) == 1
    shapes = [(24, 4290, 128), (32, 8192, 128), (16, 1024, 64), (16, 2048, 64), (16, 4096, 64)]
    assert seen == [("cpu", ["float32"], shapes, ["chunked"], 1024, 2)]
    out, err = capsys.readouterr()
    name, arch = profiles._device_name("cpu")
    assert out.splitlines()[0] == (f"# tuning cpu ({name} / {arch}), torch {torch.__version__}, "
                                   f"{torch.get_num_threads()} threads, dtypes ['float32'], shapes {shapes}")
    assert err == ("error: no shape could be tuned on cpu (every candidate tile failed; see the lines above): "
                   "nothing saved; try --rows smaller, --max-n smaller or fewer --presets\n")
    assert tune.main(["--layouts", "0"]) == 1 and seen[-1] == seen[0]  # 0 rounds: tune
    monkeypatch.setattr(cli_args, "default_device", lambda: "cuda")  # on a GPU: float16
    monkeypatch.setattr(tune, "_device_name", lambda device: ("GPU", "sm_90"))
    monkeypatch.setattr(profiles, "_device_name", lambda device: ("GPU", "sm_90"))  # the profile's file name
    assert tune.main(["--presets", "reference"]) == 1 and seen[-1][:2] == ("cuda", ["float16"])


def test_tune_cli_layouts_times_each_dtype_and_shape_and_saves_nothing(monkeypatch, capsys, profdir):
    """--layouts ROUNDS: the layout check at every (dtype, shape), rows capped at N, ROUNDS rounds; no tuning."""
    seen = []
    monkeypatch.setattr(tune, "layout_check", lambda h, n, d, dt, dev, rows, rounds, log: seen.append(
        (h, n, d, dt, dev, rows, rounds)))
    monkeypatch.setattr(tune, "tune", lambda *a, **kw: pytest.fail("--layouts must not tune"))
    assert tune.main(["--layouts", "3", "--presets", "reference,wan22-5b-480p", "--max-n", "2048", "--rows", "1536",
                      "--dtype", "fp32,bf16", "--device", "cpu"]) == 0
    shapes = [(16, 1024, 64), (16, 2048, 64), (24, 2048, 128)]
    assert seen == [(h, n, d, dt, "cpu", min(1536, n), 3) for dt in ("float32", "bfloat16") for h, n, d in shapes]
    assert capsys.readouterr().out.startswith("# layouts on cpu (")
    assert os.listdir(profdir) == []


# ------------------------------------------------------------------ profiles: validation, nearest entry, switches
def test_bytes_per_score_is_the_planners_for_every_tier_and_dtype():
    """The profile hook checks a tuned tile against the budget at the planner's own cost per score
    (memory.bytes_per_score): a different figure would take tiles the planner would refuse, or refuse good ones."""
    from attention_core.kernel import memory
    from attention_core.kernel.numerics import choose_numerics
    from attention_core.kernel.problem import normalize
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        q = torch.zeros(1, 2, 8, 4, dtype=dt)
        p = normalize(q, q, q)
        for tier in ("chunked", "inplace", "online"):
            assert profiles.bytes_per_score(tier, dt) == memory.bytes_per_score(
                tier, p, choose_numerics(p.dtype, p.device)), (dt, tier)
            if dt == torch.bfloat16:
                continue  # off the CPU bf16 may compute in bf16 or fp32 (numerics): the profile counts 4 bytes
            meta = normalize(*(torch.zeros(1, 2, 8, 4, dtype=dt, device="meta") for _ in range(3)))
            assert profiles.bytes_per_score(tier, dt, "meta") == memory.bytes_per_score(
                tier, meta, choose_numerics(meta.dtype, meta.device)), (dt, tier, "meta")
    assert [profiles.bytes_per_score(t, torch.float32) for t in ("chunked", "inplace", "online")] == [4, 4, 4]
    assert [profiles.bytes_per_score(t, torch.float32, "cuda") for t in ("chunked", "inplace", "online")] == [8, 4, 4]
    assert [profiles.bytes_per_score(t, torch.float16, "cuda") for t in ("chunked", "inplace", "online")] == [10, 6, 6]
    assert [profiles.bytes_per_score(t, torch.bfloat16, "cuda") for t in ("chunked", "inplace", "online")] == [8, 4, 6]


def test_validate_profile_says_what_is_wrong_with_each_dropped_entry():
    """The warning a user reads about a hand-edited or damaged profile names each bad entry and why."""
    good = entry()
    assert profiles.validate_profile([good]) == (None, ["a JSON list, not a profile object"])
    assert profiles.validate_profile({"version": 2, "entries": []}) == (
        None, ["version 2, this engine reads version 1"])
    assert profiles.validate_profile({"version": 1, "entries": {}}) == (None, ["'entries' is dict, not a list"])
    bad = ["x", entry(tier="auto"), entry(dtype=16), entry(block_q=0), entry(heads_per_group=True),
           entry(n=2.5), entry(use="yes")]
    prof, problems = profiles.validate_profile({"version": 1, "entries": [good, *bad, entry(block_q=1, n=1)]})
    assert prof["entries"] == [good, entry(block_q=1, n=1)]  # 1 is a valid count
    assert problems == ["7 of 9 entries dropped", "entry 1: str instead of an object",
                        "entry 2: tier 'auto' is not one of chunked, inplace, online",
                        "entry 3: dtype 16 is not a dtype name", "entry 4: block_q 0 is not an integer >= 1",
                        "entry 5: heads_per_group True is not an integer >= 1",
                        "entry 6: n 2.5 is not an integer >= 1", "entry 7: use 'yes' is not true/false"]
    assert profiles.validate_profile({"version": 1, "entries": [good]}) == ({"version": 1, "entries": [good]}, [])
    prof, problems = profiles.validate_profile({"version": 1, "entries": [], "layouts": {"float32": "keys",
                                                                                         "float16": "rows"}})
    assert prof["layouts"] == {"float32": "keys"}
    assert problems == ["layouts['float16'] 'rows' is not one of queries, keys; dropped"]
    prof, problems = profiles.validate_profile({"version": 1, "entries": [], "layouts": "keys"})
    assert prof["layouts"] == {} and problems == ["'layouts' is str, not an object of dtype: layout; ignored"]


def _lookup_n_heads(entries, heads, n, monkeypatch, dim=128):
    monkeypatch.setattr(profiles, "load_profile", lambda device="cpu": {"version": 1, "entries": entries})
    e = profiles.lookup((1, heads, n, dim), torch.float32)
    return None if e is None else (e["heads"], e["n"])


def test_the_nearest_tuned_shape_serves_key_and_head_counts_within_2x(monkeypatch):
    """A tuned tile serves shapes with key and head counts within 2x of the tuned ones (both bounds included),
    the nearest by the sum of the log ratios; farther shapes get the engine's own plan."""
    one = [entry(heads=24, n=4096)]
    for heads, n in ((24, 2048), (24, 8192), (12, 4096), (48, 4096), (12, 8192)):
        assert _lookup_n_heads(one, heads, n, monkeypatch) == (24, 4096), (heads, n)
    for heads, n in ((24, 2047), (24, 8193), (11, 4096), (49, 4096)):
        assert _lookup_n_heads(one, heads, n, monkeypatch) is None, (heads, n)
    two = [entry(heads=24, n=2048), entry(heads=24, n=8192)]
    assert _lookup_n_heads(two, 24, 3000, monkeypatch) == (24, 2048)
    assert _lookup_n_heads(two, 24, 6000, monkeypatch) == (24, 8192)
    # 2x off in heads vs 1.5x off in keys: the smaller total distance wins
    mixed = [entry(heads=12, n=4096), entry(heads=24, n=6144)]
    assert _lookup_n_heads(mixed, 24, 4096, monkeypatch) == (24, 6144)
    # other tier, dtype or head dim: no entry; an entry the engine's plan beat is still looked up
    assert _lookup_n_heads([entry(tier="online")], 24, 4096, monkeypatch) is None
    assert _lookup_n_heads([entry(dim=64)], 24, 4096, monkeypatch) is None
    assert _lookup_n_heads([entry(dtype="float16")], 24, 4096, monkeypatch) is None
    assert _lookup_n_heads([entry(use=False)], 24, 4096, monkeypatch) == (24, 4096)


def test_a_rescaled_tile_keeps_at_least_16_rows_and_at_most_the_calls():
    """Chunked rows scale with tuned keys / call keys, floor 16 rows (MIN_ROWS), ceiling the call's query rows; the
    key block is always all keys; 'all heads' (heads_per_group = tuned heads) means all heads of the call."""
    e = entry(block_q=64, n=1024, heads=8, heads_per_group=8)
    assert profiles.tuned_blocks_for(e, 16, 8192, 8192) == (16, 8192, 16)  # 64 x 1024 / 8192 = 8 -> 16
    assert profiles.tuned_blocks_for(e, 16, 8192, 2048) == (32, 2048, 16)
    assert profiles.tuned_blocks_for(e, 4, 10, 512) == (10, 512, 4)  # 128 rows > the call's 10
    assert profiles.tuned_blocks_for(entry(heads=8, heads_per_group=2), 4, 4096, 4096) == (128, 4096, 2)
    assert profiles.tuned_blocks_for(entry(heads=8, heads_per_group=4), 2, 4096, 4096) == (128, 4096, 2)
    online = entry(tier="online", block_q=256, block_kv=1024, n=8192)
    assert profiles.tuned_blocks_for(online, 24, 4096, 2048) == (256, 1024, 4)
    assert profiles.tuned_blocks_for(online, 24, 100, 700) == (100, 700, 4)


@pytest.mark.parametrize("value,used", [("off", False), ("OFF", False), ("0", False), ("false", False),
                                        ("No", False), ("on", True), ("", True)])
def test_the_tune_switch_turns_profiles_and_their_layouts_off(profdir, monkeypatch, value, used):
    prof = {"version": profiles.PROFILE_VERSION, "entries": [entry()], "layouts": {"float32": "keys"}}
    profiles.save_profile(prof, "cpu")
    monkeypatch.setenv(profiles.ENV_SWITCH, value)
    got = profiles.tuned_blocks("cpu", torch.float32, 24, 4096, 4096, 128, "chunked", 1 << 30)
    assert got == ((128, 4096, 4) if used else None)
    # the profile measured keys-major; without it the CPU's default, queries-major
    assert profiles.score_layout("cpu", torch.float32) == ("keys" if used else "queries")


def test_score_layout_the_override_then_the_profile_then_the_device_default(profdir, monkeypatch):
    profiles.save_profile({"version": 1, "entries": [], "layouts": {"float32": "keys"}}, "cpu")
    monkeypatch.setenv(profiles.ENV_LAYOUT, " Queries ")
    assert profiles.score_layout("cpu", torch.float32) == "queries"
    monkeypatch.delenv(profiles.ENV_LAYOUT)
    assert profiles.score_layout("cpu", torch.float32) == "keys"
    assert profiles.score_layout("cpu", torch.float64) == "queries"  # no measurement for float64: the CPU's default
    monkeypatch.setattr(profiles, "load_profile", lambda device="cpu": None)
    assert profiles.score_layout("meta", torch.float32) == "queries"  # not a CPU: queries-major


def test_profile_name_is_a_lower_case_slug_of_device_arch_and_torch(monkeypatch):
    monkeypatch.setattr(profiles, "_device_name", lambda device: ("AMD Instinct MI50/MI60", "gfx906"))
    monkeypatch.setattr(torch, "__version__", "2.5.1+rocm6.2")
    assert profiles.profile_name("cuda") == "amd-instinct-mi50-mi60-gfx906-torch2-5-1-rocm6-2.json"


def test_profile_dirs_in_order_without_duplicates(monkeypatch, tmp_path):
    """ComfyUI's user folder first, then $TILED_ATTENTION_PROFILE_DIR (or the user cache); the same folder once;
    a profile is read from the first folder that has it, and written to the first folder."""
    import types
    user = tmp_path / "user"
    monkeypatch.setitem(sys.modules, "folder_paths", types.SimpleNamespace(get_user_directory=lambda: str(user)))
    monkeypatch.setenv(profiles.ENV_DIR, str(user / "tiled-attention"))
    assert profiles.profile_dirs() == [str(user / "tiled-attention")]
    monkeypatch.setenv(profiles.ENV_DIR, str(tmp_path / "env"))
    assert profiles.profile_dirs() == [str(user / "tiled-attention"), str(tmp_path / "env")]
    (tmp_path / "env").mkdir()
    (tmp_path / "env" / "p.json").write_text("{}")
    assert profiles.find_profile_file("p.json") == str(tmp_path / "env" / "p.json")
    assert profiles.find_profile_file("q.json") == str(user / "tiled-attention" / "q.json")
    monkeypatch.delenv(profiles.ENV_DIR)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert profiles.profile_dirs()[1] == str(tmp_path / "home" / ".cache" / "tiled-attention")
    # a ComfyUI without a user directory (an old one, or one that raises): the per-user folder only
    monkeypatch.setitem(sys.modules, "folder_paths", types.SimpleNamespace())
    assert profiles.profile_dirs() == [str(tmp_path / "home" / ".cache" / "tiled-attention")]
    monkeypatch.setitem(sys.modules, "folder_paths", types.SimpleNamespace(get_user_directory=lambda: 1 / 0))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert profiles.profile_dirs() == [str(tmp_path / "xdg" / "tiled-attention")]


def test_tune_logs_the_layout_kept_and_records_the_run_in_the_profile(monkeypatch):
    """tune(): every (dtype, tier, shape) tuned in that order; the layout check at each shape on min(rows, N) rows
    with LAYOUT_ROUNDS rounds; the line saying which layout is kept; the profile says what it was measured on."""
    tuned, checked = [], []
    monkeypatch.setattr(tune, "tune_shape", lambda h, n, d, dt, dev, tier, rows, rep, log: tuned.append(
        (h, n, d, dt, dev, tier, rows, rep)) or {"n": n})
    monkeypatch.setattr(tune, "layout_check", lambda h, n, d, dt, dev, rows, rounds, log: checked.append(
        (h, n, dt, rows, rounds)) or {"queries_major_ms": 2.0, "keys_major_ms": 1.0})
    lines = []
    shapes = [(4, 256, 32), (8, 2048, 32)]
    prof = tune.tune("cpu", ["float32", "float16"], shapes, ["chunked", "online"], 1024, 3, log=lines.append)
    assert tuned == [(h, n, d, dt, "cpu", tier, 1024, 3) for dt in ("float32", "float16")
                     for tier in ("chunked", "online") for h, n, d in shapes]
    assert checked == [(h, n, dt, min(1024, n), 4) for dt in ("float32", "float16") for h, n, d in shapes]
    assert tune.LAYOUT_ROUNDS == 4
    assert lines == [f"  chunked {dt}: score layout kept: keys-major" for dt in ("float32", "float16")]
    name, arch = profiles._device_name("cpu")
    assert prof["layouts"] == {"float32": "keys", "float16": "keys"} and len(prof["entries"]) == 8
    assert (prof["version"], prof["device"], prof["arch"], prof["torch"], prof["threads"]) == (
        profiles.PROFILE_VERSION, name, arch, torch.__version__, torch.get_num_threads())
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", prof["created"]), prof["created"]


def test_tune_says_why_the_layouts_were_not_compared(monkeypatch):
    monkeypatch.setattr(tune, "tune_shape", lambda *a: {})
    monkeypatch.setattr(tune, "layout_check", lambda *a: (_ for _ in ()).throw(MemoryError("no room")))
    lines = []
    prof = tune.tune("cpu", ["float32"], [(4, 256, 32)], ["chunked"], 64, 1, log=lines.append)
    assert lines == ["  chunked float32: score layouts not compared (MemoryError: no room); default kept"]
    assert "layouts" not in prof


def test_tune_cli_says_where_it_saved_and_whether_auto_reads_it(monkeypatch, capsys, profdir):
    monkeypatch.setattr(tune, "tune", lambda *a, **kw: {"version": 1, "entries": [entry()]})
    assert tune.main(["--device", "cpu"]) == 0
    path = profiles.profile_path("cpu")
    base = os.path.basename(path)
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"saved {path}; tier 'auto' uses it, in ComfyUI too (unless <ComfyUI user directory>/tiled-attention/{base} "
        "exists, which ComfyUI reads first; TILED_ATTENTION_TUNE=off ignores profiles)")
    other = profdir / "other.json"
    assert tune.main(["--device", "cpu", "--out", str(other)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"saved {other}; tier 'auto' does not read this path: it reads {path} (inside ComfyUI first <ComfyUI user "
        f"directory>/tiled-attention/{base}); copy the file there to use it")
    with open(other) as f:
        assert json.load(f)["entries"] == [entry()]


def test_the_warning_about_a_bad_profile_names_it_and_says_how_to_fix_it(profdir, caplog):
    path = write([entry(), entry(block_q=0)])
    with caplog.at_level("WARNING"):
        prof = profiles.load_profile("cpu")
    assert prof["entries"] == [entry()]
    assert [r.getMessage() for r in caplog.records] == [
        f"tiled attention: the tuned profile {path} is not usable as written (ignoring the problems listed): "
        "1 of 2 entries dropped; entry 1: block_q 0 is not an integer >= 1. Re-run `python -m attention_core.tune` "
        "to rewrite it, or delete it."]



def test_run_blocks_takes_a_profile_entry_with_its_tier_and_rescaled_tile(monkeypatch):
    """tune's helper run on a profile entry: the entry's tier and its tile for this shape (tuned_blocks_for), one
    call per head group, the last group the remainder."""
    calls = []

    def spy(q, k, v, tier, block_q, block_kv):
        calls.append((q.shape[1], tier, block_q, block_kv))
        return torch.zeros_like(q)
    monkeypatch.setattr(tune, "scaled_dot_product_attention", spy)
    q = torch.zeros(1, 6, 64, 8)
    tune.run_blocks(q, q, q, entry(tier="online", heads=6, n=64, block_q=32, block_kv=16, heads_per_group=4))
    assert calls == [(4, "online", 32, 16), (2, "online", 32, 16)]
    calls.clear()
    tune.run_blocks(q, q, q, entry(heads=6, n=32, block_q=32, heads_per_group=6), tier="online")
    assert calls == [(6, "chunked", 16, 64)]  # 32 rows x 32 tuned keys / 64 keys


def test_the_cpus_name_is_its_model_name(monkeypatch):
    """A CPU profile is named for the model in /proc/cpuinfo, else platform.processor(), else 'cpu'."""
    import io
    import platform
    cpuinfo = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13 64-Core: x\nmodel name\t: other\n"
    monkeypatch.setattr(profiles, "open", lambda path: io.StringIO(cpuinfo), raising=False)
    monkeypatch.setattr(platform, "processor", lambda: "x86_64")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert profiles._device_name("cpu") == ("AMD EPYC 7B13 64-Core: x", "x86_64")

    def no_file(path):
        raise OSError(path)
    monkeypatch.setattr(profiles, "open", no_file, raising=False)
    assert profiles._device_name("cpu") == ("x86_64", "x86_64")
    monkeypatch.setattr(platform, "processor", lambda: "")
    monkeypatch.setattr(platform, "machine", lambda: "")
    assert profiles._device_name("cpu") == ("cpu", "cpu")


def test_the_layout_check_times_scores_at_attentions_scale(monkeypatch):
    """The chunked loop has no scale argument: the layout check folds the default softmax scale 1/sqrt(D) into the
    queries, so its scores of unit-normal inputs have unit spread, as the engine's (not D or 1/D times that)."""
    seen = []
    real = tune._chunked_loop

    def spy(q, k, v, bq, keys_major):
        seen.append((q @ k.transpose(-1, -2)).std().item())
        return real(q, k, v, bq, keys_major)
    monkeypatch.setattr(tune, "_chunked_loop", spy)
    tune.layout_check(2, 256, 64, "float32", "cpu", 64, 1, log=lambda s: None)
    assert seen and all(0.85 < s < 1.15 for s in seen), seen


@pytest.mark.parametrize("small,large", [((64, 1024, 2), (128, 1024, 2)), ((64, 1024, 2), (64, 1024, 4)),
                                         ((64, 512, 2), (64, 1024, 2))])
def test_choose_counts_rows_keys_and_heads_in_a_tiles_size(small, large):
    """The size that decides is rows x keys x heads: a tile smaller in any one of them is kept over a 1 % faster
    larger one."""
    assert tune.choose([(large, 1.0), (small, 1.01)]) == (small, 1.01)
    assert tune.choose([(small, 1.01), (large, 1.0)]) == (small, 1.01)


# ------------------------------------------------------------------------- an output that cannot be written
def _refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        tune.main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err, (out, err)
    return err.rstrip("\n")


def test_an_unwritable_profile_is_refused_before_tuning(profdir, monkeypatch, capsys, unwritable_folder):
    """Issue 22.6: --out under a file or in a folder nothing can be created in (tried: root passes permission
    bits), or such a default profile folder: one error line, exit 2, before minutes of tuning; --layouts saves
    nothing, so it is not refused."""
    monkeypatch.setattr(tune, "tune", lambda *a, **kw: pytest.fail("tuned before checking where to save"))
    blocker = profdir / "file"
    blocker.write_text("a file, not a folder")
    ro = unwritable_folder(profdir / "read-only")
    assert _refused(["--device", "cpu", "--out", str(blocker / "p.json")], capsys) == (
        f"error: argument --out: {str(blocker)!r} is a file, not a folder; expected a file path in an existing folder")
    assert _refused(["--device", "cpu", "--out", str(ro / "p.json")], capsys).startswith(
        f"error: argument --out: folder {str(ro)!r} is not writable")
    for folder, why in [(blocker / "profiles", f"{str(blocker)!r} is a file, not a folder"),
                        (ro, f"folder {str(ro)!r} is not writable")]:
        monkeypatch.setenv(profiles.ENV_DIR, str(folder))
        target = os.path.join(str(folder), profiles.profile_name("cpu"))
        err = _refused(["--device", "cpu"], capsys)
        assert err.startswith(f"error: argument --out: cannot write the default profile {target!r}: {why}"), err
        assert err.endswith("; pass --out FILE (or set TILED_ATTENTION_PROFILE_DIR)")
    monkeypatch.setattr(tune, "layout_check", lambda *a, **kw: None)
    assert tune.main(["--device", "cpu", "--layouts", "1", "--presets", "reference"]) == 0
    assert os.listdir(ro) == []


def test_a_profile_that_cannot_be_written_after_tuning_is_kept(profdir, monkeypatch, capsys, tmp_path):
    """Checked up front, the write can still fail later (the folder removed, the disk full): one error line
    naming the temporary file that holds the profile, exit 2, no traceback."""
    import errno
    import tempfile
    monkeypatch.setattr(tune, "tune", lambda *a, **kw: {"version": 1, "entries": [entry()]})

    def gone(prof, device, path):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory")
    monkeypatch.setattr(tune, "save_profile", gone)
    kept_dir = tmp_path / "kept"
    kept_dir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(kept_dir))
    out = str(profdir / "p.json")
    assert tune.main(["--device", "cpu", "--out", out]) == 2
    err = capsys.readouterr().err
    (kept,) = kept_dir.iterdir()
    assert err == f"error: could not write {out!r} (No such file or directory); the profile is in {str(kept)!r}: " \
                  "copy it there\n"
    prof = json.loads(kept.read_text())
    assert prof["entries"] == [entry()] and "load" in prof

"""Profiles and calibrations are untrusted files: whatever they hold, no consumer fails and each version of a bad
file is ONE warning and the defaults (issue 22 items 4 and 5).

Seeded fuzzing of valid files (values swapped for other types, huge / negative / non-finite numbers, deep
nesting, deleted and added keys, truncation, bit flips, random bytes), each version written the way a user's
editor or a crash leaves it, then read by the real consumers:
  profiles    load_profile, tuned_blocks and lookup of every tier, the chunked tier's layout choice
              (score_layout), and a few hundred attention calls (tier auto and chunked) through
              attention_core.scaled_dot_product_attention on tiny float64 tensors
  calibrations  calibration.load, the estimate (estimate.run_time / report of every model), plan.time_report
              (what the Attention Fit node shows) and `python -m attention_core.plan --calibration FILE`
The oracle: no exception; a file whose loaded value is not exactly its parsed content (rejected, or entries
dropped) warns exactly once across all of its reads, a file loaded as written never; a rejected file gives
exactly the default path's results (bitwise for attention, the "no calibration" text for the plan); a usable one
gives tiles within [1, N], a layout of the two, finite positive times, attention equal to torch's in float64.
Plus the named cases of the issue and the files that are not files: a FIFO, a folder, an unreadable file, a
file past the size limit (a 2 GB sparse one in a process limited to far less memory).
"""
import contextlib
import io
import json
import logging
import math
import os
import random
import subprocess
import sys
import threading

import pytest
import torch

from attention_core.device import calibration, jsonfile, profiles
from attention_core.cli import estimate, plan
from attention_core import scaled_dot_product_attention as sdpa
from reference import math_sdpa

# ------------------------------------------------------------------------------------------------ mutations
# raw JSON texts a value may become (written verbatim: some are not JSON at all, some exceed what json.dumps or
# Python's int conversion accept)
RAW = ["9" * 400, "-" + "9" * 400, "9" * 5000, "1e400", "-1e400", "NaN", "Infinity", "-Infinity", "5e-324",
       "0", "-1", "1", "1.5", "-0.0", "2147483647", "2147483648", "1e8", "1e-7", "true", "false", "null", '""',
       '"nan"', '"inf"', '"-1"', '"4096"', '"keys"', '"float64"', "[]", "{}", "[1, 2]", '{"n": 1}',
       "[" * 40 + "]" * 40, '{"a": ' * 40 + "1" + "}" * 40, "[" * 100000, "[" * 3000 + "]" * 3000,
       '"' + "x" * 5000 + '"', '"\\u0000\\n"', '"\\ud800"', "01", "+1", "1e", "[1,]", "'x'"]
KEYS = ["n", "heads", "dim", "block_q", "block_kv", "heads_per_group", "tier", "dtype", "use", "version",
        "entries", "layouts", "tokens", "gflops", "gemm", "attention", "pack", "subquad", "device", "date", "x"]


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _set(obj, path, value):
    for p in path[:-1]:
        obj = obj[p]
    obj[path[-1]] = value


def _mutated_text(rng: random.Random, valid: dict) -> bytes:
    """One damaged version of `valid`: value mutations (to a raw text, a deletion, an added key), then maybe a
    byte-level one (truncation, bit flips, inserted bytes), or nothing but random bytes."""
    if rng.random() < 0.08:
        return bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 400)))
    obj = json.loads(json.dumps(valid))
    raws = []
    for _ in range(rng.randint(1, 3)):
        paths = list(_paths(obj))
        path = rng.choice(paths)
        what = rng.random()
        if not path:  # the whole file
            if what < 0.5:
                raws.append(rng.choice(RAW))
                obj = f"@@RAW{len(raws) - 1}@@"
            continue
        if what < 0.7:
            raws.append(rng.choice(RAW))
            _set(obj, path, f"@@RAW{len(raws) - 1}@@")
        elif what < 0.85:
            parent = obj
            for p in path[:-1]:
                parent = parent[p]
            del parent[path[-1]]
        else:
            parent = obj
            for p in path[:-1]:
                parent = parent[p]
            if isinstance(parent, dict):
                raws.append(rng.choice(RAW))
                parent[rng.choice(KEYS)] = f"@@RAW{len(raws) - 1}@@"
            else:
                parent.append(json.loads(json.dumps(rng.choice(parent))) if parent else 1)
    text = json.dumps(obj, indent=rng.choice([None, 1]))
    for i, raw in enumerate(raws):
        text = text.replace(f'"@@RAW{i}@@"', raw)
    data = text.encode("utf-8")
    r = rng.random()
    if r < 0.1 and data:
        data = data[:rng.randrange(len(data))]
    elif r < 0.2 and data:
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        data = bytes(b)
    elif r < 0.25:
        i = rng.randrange(len(data) + 1)
        data = data[:i] + bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 8))) + data[i:]
    return data


def _write_version(path: str, data: bytes):
    """A new version of the file: a fresh inode (written aside, renamed over), as an editor or tune writes it."""
    tmp = path + ".new"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _parsed(data: bytes):
    """The file's content as Python's json reads it, serialised again to compare (None: not JSON)."""
    try:
        return json.dumps(json.loads(data.decode("utf-8")), sort_keys=True)
    except (ValueError, RecursionError):
        return None


def _canon(value):
    return None if value is None else json.dumps(value, sort_keys=True)


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())


@pytest.fixture
def warnings_seen():
    handler = _Warnings()
    logger = logging.getLogger("attention_core")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.WARNING)
    yield handler.records
    logger.removeHandler(handler)
    logger.setLevel(old)


# --------------------------------------------------------------------------------------------- profiles
H, L, D = 2, 24, 8  # the tiny attention calls: [1, H, L, D] float64


def _valid_profile():
    def e(tier, bq, bkv, hpg):
        return {"tier": tier, "dtype": "float64", "heads": H, "dim": D, "n": L, "rows_timed": L, "block_q": bq,
                "block_kv": bkv, "heads_per_group": hpg, "ms": 1.0, "untuned_ms": 2.0, "use": True}
    return {"version": 1, "device": "fuzz", "arch": "x", "torch": torch.__version__,
            "entries": [e("chunked", 16, L, 1), e("inplace", 16, L, 2), e("online", 8, 8, 1)],
            "layouts": {"float64": "queries"}}


def _tiny_qkv(seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, H, L, D, generator=g, dtype=torch.float64) for _ in range(3)]


SHAPES = [(H, L, L), (1, 1, 1), (3, 40, 40), (H, 7, 30)]  # (heads, Lq, Lk) asked of tuned_blocks


def _profile_consumers(path):
    """Every profile consumer but the attention call; checks what a usable answer must satisfy."""
    for tier in profiles.TIER_NAMES:
        for heads, lq, lk in SHAPES:
            got = profiles.tuned_blocks("cpu", torch.float64, heads, lq, lk, D, tier, 1 << 30)
            if got is not None:
                bq, bkv, hpg = got
                assert all(isinstance(x, int) for x in got) and 1 <= bq <= lq and 1 <= bkv <= lk \
                    and 1 <= hpg <= heads, (tier, heads, lq, lk, got)
        entry = profiles.lookup((1, H, L, D), torch.float64, "cpu", tier)
        assert entry is None or profiles._entry_problem(entry) is None
    layout = profiles.score_layout("cpu", torch.float64)
    assert layout in profiles.LAYOUTS
    return layout


def test_fuzzed_profiles_never_fail_a_call_and_warn_once_per_version(profdir, warnings_seen):
    """2,500 seeded damaged profiles: the loader, tuned_blocks / lookup / score_layout for every tier, and for
    every eighth one attention calls with tier auto and chunked."""
    q, k, v = _tiny_qkv()
    ref = math_sdpa(q, k, v)
    default = {t: sdpa(q, k, v, tier=t) for t in ("auto", "chunked")}  # no profile at all
    path = profiles.profile_path("cpu")
    assert os.path.dirname(path) == str(profdir)
    rng = random.Random(220004)
    valid = _valid_profile()
    rejected = used = 0
    for case in range(2500):
        data = _mutated_text(rng, valid)
        _write_version(path, data)
        warnings_seen.clear()
        value = profiles.load_profile("cpu")
        layout = _profile_consumers(path)
        calls = case % 8 == 0
        if calls:
            for tier, out in default.items():
                got = sdpa(q, k, v, tier=tier)
                if value is None:
                    assert torch.equal(got, out), (case, tier, data[:200])
                else:
                    assert (got - ref).abs().max().item() < 1e-12, (case, tier, data[:200])
        _profile_consumers(path)  # read again: still one warning for this version
        changed = value is None or _canon(value) != _parsed(data)
        assert len(warnings_seen) == (1 if changed else 0), (case, data[:300], warnings_seen)
        if changed:
            assert path in warnings_seen[0]
        if value is None:
            rejected += 1
            assert layout == profiles.DEFAULT_LAYOUT["cpu"]
            assert all(profiles.tuned_blocks("cpu", torch.float64, H, L, L, D, t, 1 << 30) is None
                       for t in profiles.TIER_NAMES)
        else:
            used += 1
    assert rejected > 500 and used > 500, (rejected, used)  # the sample exercises both sides


@pytest.mark.parametrize("text", [
    # the issue's cases: a 400-digit n or heads (OverflowError on every auto call), 100,000 '[' (RecursionError
    # on every auto and chunked call)
    json.dumps(_valid_profile()).replace(f'"n": {L}', '"n": ' + "9" * 400, 1),
    json.dumps(_valid_profile()).replace(f'"heads": {H}', '"heads": ' + "9" * 400, 1),
    "[" * 100000,
    '{"version": 1, "entries": ' + "[" * 5000 + "]" * 5000 + "}",
    '{"version": 1, "entries": [' + '{"a": ' * 900 + "1" + "}" * 900 + "]}",
    json.dumps(_valid_profile()).replace('"version": 1', '"version": true'),
])
def test_the_issues_profiles_warn_once_and_calls_are_exact(profdir, warnings_seen, text):
    q, k, v = _tiny_qkv()
    ref = math_sdpa(q, k, v)
    path = profiles.profile_path("cpu")
    _write_version(path, text.encode())
    for _ in range(2):
        for tier in ("auto", "chunked"):
            assert (sdpa(q, k, v, tier=tier) - ref).abs().max().item() < 1e-12
        _profile_consumers(path)
    assert len(warnings_seen) == 1 and path in warnings_seen[0], warnings_seen


# ---------------------------------------------------------------------------------------- not a regular file
def test_a_fifo_at_the_profile_path_is_one_warning_not_a_hang(profdir, warnings_seen):
    """open() of a FIFO blocks until a writer comes: every attention call hung. Now: one warning, the defaults."""
    path = profiles.profile_path("cpu")
    os.mkfifo(path)
    q, k, v = _tiny_qkv()
    done = []
    t = threading.Thread(target=lambda: done.append([sdpa(q, k, v, tier=x) for x in ("auto", "chunked", "auto")]),
                         daemon=True)
    t.start()
    t.join(120)  # a hang guard, not a speed check: the calls take milliseconds
    if t.is_alive():  # unblock the reader (a writer that closes at once) before failing
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(10)
        pytest.fail("an attention call blocked opening the FIFO at the profile path")
    ref = math_sdpa(q, k, v)
    assert all((o - ref).abs().max().item() < 1e-12 for o in done[0])
    assert len(warnings_seen) == 1 and "not a regular file" in warnings_seen[0], warnings_seen


def test_a_folder_at_the_profile_path_is_one_warning(profdir, warnings_seen):
    path = profiles.profile_path("cpu")
    os.mkdir(path)
    for _ in range(3):
        assert profiles.load_profile("cpu") is None
        assert profiles.score_layout("cpu", torch.float64) == profiles.DEFAULT_LAYOUT["cpu"]
    assert len(warnings_seen) == 1 and "a folder" in warnings_seen[0], warnings_seen


def test_an_unreadable_profile_is_one_warning_and_read_again_once_readable(profdir, warnings_seen, monkeypatch):
    """Without read permission the file was silently ignored; now it is said once, and a chmod that makes it
    readable is seen (the mode is part of the file's version). As root (who reads anything) the refusal of the
    open is stood in by the same PermissionError the kernel gives."""
    path = profiles.save_profile(_valid_profile(), "cpu")
    os.chmod(path, 0o000)
    if os.geteuid() == 0:
        real_open = os.open

        def refusing(p, flags, *a, **kw):
            if p == path and not os.stat(p).st_mode & 0o444:
                raise PermissionError(13, "Permission denied", p)
            return real_open(p, flags, *a, **kw)
        monkeypatch.setattr(os, "open", refusing)
    for _ in range(3):
        assert profiles.load_profile("cpu") is None
    assert len(warnings_seen) == 1 and "Permission denied" in warnings_seen[0], warnings_seen
    os.chmod(path, 0o644)
    assert profiles.load_profile("cpu")["entries"] == _valid_profile()["entries"]
    assert len(warnings_seen) == 1


def test_a_file_past_the_size_limit_is_one_warning_and_not_read(profdir, warnings_seen):
    """A valid profile padded just past jsonfile.MAX_BYTES is refused with a warning saying why."""
    path = profiles.profile_path("cpu")
    text = json.dumps(_valid_profile()).encode()
    _write_version(path, text + b" " * (jsonfile.MAX_BYTES + 1 - len(text)))
    for _ in range(3):
        assert profiles.load_profile("cpu") is None
    assert len(warnings_seen) == 1 and "larger than the 8 MB" in warnings_seen[0], warnings_seen
    _write_version(path, text + b" " * (jsonfile.MAX_BYTES - len(text)))  # at the limit: read
    assert profiles.load_profile("cpu")["entries"] == _valid_profile()["entries"]


_HUGE = r"""
import importlib.util, logging, os, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))  # 1 GB of address space: a 2 GB read cannot happen
spec = importlib.util.spec_from_file_location("jsonfile", sys.argv[1])
jsonfile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(jsonfile)
logging.basicConfig(level=logging.WARNING, format="%(message)s")
for _ in range(3):
    assert jsonfile.load_json_validated(sys.argv[2], lambda o: (o, []), {}, what="profile") is None
print("done")
"""


def test_a_2_gb_file_is_refused_without_reading_it(tmp_path):
    """A 2 GB (sparse) file at the path: refused from its size, in a process whose address space (1 GB) could
    not hold it, so reading it whole would fail there."""
    path = tmp_path / "huge.json"
    with open(path, "wb") as f:
        f.truncate(2 << 30)
    src = os.path.join(os.path.dirname(jsonfile.__file__), "jsonfile.py")
    r = subprocess.run([sys.executable, "-c", _HUGE, src, str(path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout == "done\n", r.stderr[-2000:]
    assert r.stderr.count("larger than the 8 MB") == 3, r.stderr  # no cache given: once per read
    assert "2,048.0 MB" in r.stderr


# ----------------------------------------------------------------------------------------- calibrations
def _valid_calibration(version: int = 2):
    """A usable calibration of the current format (math SDPA and torch's default, named), or of version 1 (its
    "math" was torch's default; read upgraded)."""
    extra = ({"torch": [{"tokens": 1024, "heads": 8, "head_dim": 128, "gflops": 90.0}]} if version == 2 else {})
    return {"version": version, "device": "fuzz device", "dtype": "fp32", "date": "2026-12-02 04:00 UTC",
            **({"torch_default": "flash_attention"} if version == 2 else {}),
            "attention": {"pack": [{"tokens": 1024, "heads": 8, "head_dim": 128, "gflops": 100.0},
                                   {"tokens": 4096, "heads": 8, "head_dim": 128, "gflops": 120.0}],
                          "subquad": [{"tokens": 1024, "heads": 8, "head_dim": 128, "gflops": 50.0}],
                          "math": [{"tokens": 1024, "heads": 8, "head_dim": 128, "gflops": 60.0}], **extra},
            "gemm": [{"m": 512, "k": 3072, "n": 3072, "gflops": 200.0},
                     {"m": 512, "k": 3072, "n": 14336, "gflops": 210.0}]}


SIZES = [(832, 480, 41), (1920, 1088, 129), (64, 64, 1)]
PLAN_ARGS = ["--model", "ltx23-22b", "--width", "832", "--height", "480", "--frames", "41", "--free-gb", "20",
             "--cpu"]


def _run_plan(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = plan.main(argv)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def _check_estimate(cal):
    """A usable calibration: every model's run at every size has finite positive times; the report prints."""
    for key, spec in plan.MODELS.items():
        for w, h, f in SIZES:
            rt = estimate.run_time(spec, w, h, f, cal, plan.tokens)
            for st in rt["stages"]:
                for t in st["per_step"].values():
                    assert t is None or all(math.isfinite(x) and x > 0 for x in t.values()), (key, w, t)
            assert all(t is None or (math.isfinite(t) and t > 0) for t in rt["totals"].values()), rt["totals"]
            estimate.report(spec, w, h, f, cal, "x", tokens=plan.tokens)


def test_fuzzed_calibrations_never_crash_the_estimate_and_warn_once(tmp_path, warnings_seen):
    """1,500 seeded damaged calibrations: load, the estimate of every model and size, the plan's time section
    (the Attention Fit node's), and for every fifth `plan --calibration FILE` (a bad file: one error line, exit
    2; a usable one: exit 0)."""
    path = str(tmp_path / "calibration-fuzz-fp32.json")
    est = plan.estimate("wan22-5b", 832, 480, 41, 20 * plan.GB, 2, cpu=True)
    calibration._cache.clear()
    missing = plan.time_report(est, path)  # the default path: no calibration there
    assert "no calibration" in missing
    rng = random.Random(220005)
    valids = (_valid_calibration(2), _valid_calibration(1))  # the current format and the one before (issue 38.4)
    rejected = used = 0
    for case in range(1500):
        data = _mutated_text(rng, valids[case % 2])
        _write_version(path, data)
        warnings_seen.clear()
        cal = calibration.load(path)
        text = plan.time_report(est, path)
        if cal is None:
            rejected += 1
            assert text == missing, (case, data[:300])
        else:
            used += 1
            _check_estimate(cal)
            assert "a step" in text
        if case % 5 == 0:
            code, out, err = _run_plan(PLAN_ARGS + ["--calibration", path])
            if cal is None:
                assert code == 2 and out == "" and err.count("\n") == 1, (case, code, err[-500:])
                assert err.startswith(f"error: argument --calibration: {path!r} is not a usable calibration: ")
            else:
                assert code in (0, None) and err == "" and "a step" in out, (case, code, err[-500:])
        assert calibration.load(path) is cal
        parsed = _parsed(data)
        # a usable version 1 file is read upgraded (its mislabelled "math" as torch's default): not a warning
        upgraded = parsed and _canon(calibration.upgraded(json.loads(parsed))) if cal is not None else None
        changed = cal is None or _canon(cal) != upgraded
        assert len(warnings_seen) == (1 if changed else 0), (case, data[:300], warnings_seen)
    assert rejected > 300 and used > 150, (rejected, used)


_GEMM = _valid_calibration()["gemm"][0]


@pytest.mark.parametrize("change", [
    {"gemm": [{**_GEMM, "n": 0}]}, {"gemm": [{**_GEMM, "n": -3072}]}, {"gemm": [{**_GEMM, "n": "3072"}]},
    {"gemm": [{**_GEMM, "n": None}]}, {"gemm": [{**_GEMM, "n": 10 ** 400}]}, {"gemm": [{**_GEMM, "n": 3072.5}]},
    {"gemm": [{**_GEMM, "gflops": 5e-324}]}, {"gemm": [{**_GEMM, "gflops": 1e300}]},
    {"attention": {"pack": [{"tokens": 1024, "gflops": 5e-324}]}},
    {"attention": {"pack": [{"tokens": 10 ** 400, "gflops": 100.0}]}},
    {"attention": {"pack": [{"tokens": 1024, "gflops": 100.0}], "subquad": [{"tokens": 0.5, "gflops": 1.0}]}},
    {"device": "x" * 100000}, {"date": "2026\n12"}, {"version": True},
])
def test_the_issues_calibrations_are_one_warning_and_plan_says_error(tmp_path, warnings_seen, change):
    """A GEMM entry's n of 0, negative, text, null or 400 digits reached math.log (plan: a traceback, exit 1; the
    Attention Fit node: "math domain error"); a subnormal rate passed and printed "inf h a step". Now each is
    refused: the estimate falls back to "no calibration" with one warning, and `plan --calibration FILE` says
    what is wrong in one error line, exit 2."""
    path = str(tmp_path / "c.json")
    _write_version(path, json.dumps({**_valid_calibration(), **change}).encode())
    calibration._cache.clear()
    est = plan.estimate("wan22-5b", 832, 480, 41, 20 * plan.GB, 2, cpu=True)
    for _ in range(3):
        assert calibration.load(path) is None
        assert "no calibration" in plan.time_report(est, path)
    assert len(warnings_seen) == 1 and path in warnings_seen[0], warnings_seen
    code, out, err = _run_plan(PLAN_ARGS + ["--calibration", path])
    assert code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: argument --calibration: {path!r} is not a usable calibration: "), err


def test_plan_with_a_usable_or_missing_calibration_file_still_runs(tmp_path):
    """The error line is only for a file that exists and is unusable: a missing one keeps the report's advice
    to calibrate into it, a usable one gives the times."""
    path = str(tmp_path / "c.json")
    code, out, err = _run_plan(PLAN_ARGS + ["--calibration", path])
    assert code == 0 and "no calibration" in out and f"--out {path}" in out, err
    calibration.save(_valid_calibration(), path)
    code, out, err = _run_plan(PLAN_ARGS + ["--calibration", path])
    assert code == 0 and "a step" in out and err == "", err

"""The calibration file of attention_core.cli.calibrate: where it lives, validation on load, atomic writes.

Untrusted input (a file on the user's disk): `load` validates every field the estimate reads (sane ranges, below)
and treats a bad file (whatever it holds: attention_core.device.jsonfile) as absent, with one warning naming the file
per version of it; `problem` says what is wrong for a command line's error line; `save` writes a unique temporary file
(tempfile.mkstemp) in the same folder and renames it over the old one (os.replace), so readers and other writers never
see a partial file. No torch import here.
"""
from __future__ import annotations

import os
import re
import reprlib
from typing import Optional

from . import jsonfile
from .machine_load import load_problem

VERSION = 2
# The attention rates a file of each version may hold. Version 2: "math" is torch's math SDPA (sdpa_kernel(MATH)),
# "torch" torch's default SDPA where its backend differs (the file's "torch_default" names it). Version 1 (before
# issue 38): its "math" was torch's DEFAULT SDPA (the fused flash kernel on CPUs), mislabelled; `load` still reads
# such a file, as version 2 with that rate moved to "torch", its backend unknown, no math SDPA rate, and
# "upgraded_from": 1 (V1_NOTE says so wherever the rates are shown).
KINDS = {1: ("pack", "subquad", "math"), 2: ("pack", "subquad", "math", "torch")}
V1_NOTE = ("made by an older calibrate (file version 1), whose \"math\" rate was torch's default SDPA (the fused "
           "flash kernel on CPUs and on GPUs that have one), not math SDPA: read as torch's default SDPA, backend "
           "unknown; math SDPA's rate is unknown until python -m attention_core.calibrate runs again")


def calibration_path(device: str = "cpu", dtype: str = "fp32") -> str:
    """calibration-<device name>-<dtype>.json: the first that exists in profiles.profile_dirs() (ComfyUI's user
    folder, then where a shell's calibrate writes), else where this process would write it."""
    from .profiles import _device_name, find_profile_file
    name, arch = _device_name(device)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", f"{name}-{arch}").strip("-").lower()[:80] or "device"
    return find_profile_file(f"calibration-{slug}-{dtype}.json")


# Sane ranges of every field attention_core.cli.estimate reads (anything outside is a damaged or hand-edited file):
# - rates (`gflops`, GFLOP/s): 1e-6 (a thousand FLOP/s, a million times below one slow CPU core; tests time
#   made-up tiny models that slow) to 1e7 (10 PFLOP/s, several times the fastest accelerator's dense
#   half-precision rate). A run's FLOPs (below 1e32 at the largest size, batch and steps the planner
#   accepts) over a rate in range is a finite time; a subnormal rate (5e-324) made "inf h a step", and a rate
#   near 1e308 "0.0 s".
# - attention `tokens`: 1 to 1e9 (calibrate measures 1,024-4,096; the rates are interpolated on log(tokens)).
# - GEMM `n` (output columns of the measured shape): a whole number from 1 to 2^20 (the models' widest linear
#   layer is under 20,000 columns); the estimate takes log(n / width), so 0, negatives, null, strings or a
#   400-digit number crashed it. `m` (rows) and `k` (input width), optional (an entry without them matches any
#   rows or width), whole numbers from 1 to 2^20 when present: the estimate takes their logarithms too.
# - `elementwise` (optional: calibrations made before it was measured have none): a non-empty list of entries
#   whose `gbps` (GB/s of memory-bound passes) is from 1e-6 (1 KB/s) to 1e5 (100 TB/s, twenty times the
#   fastest accelerator memory); bytes over a rate in range is a finite time, as for the FLOP rates.
# - `device`, `dtype`, `date`: printed in the report's heading: non-empty printable text of at most 200 characters.
MIN_GFLOPS, MAX_GFLOPS = 1e-6, 1e7
MAX_TOKENS = 1e9
MAX_GEMM_N = 2 ** 20
MIN_GBPS, MAX_GBPS = 1e-6, 1e5
MAX_TEXT = 200
_show = reprlib.Repr()
_show.maxstring, _show.maxother, _show.maxlong = 40, 40, 40


def _number(x, lo: float, hi: float) -> bool:
    """x is a JSON number (not true/false) with lo <= x <= hi (so finite); huge integers compare exactly."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and lo <= x <= hi


def _fmt(x) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


def _entry(r, fields, optional=None) -> Optional[str]:
    """What is wrong with a measurement entry `r` whose `fields` are {name: (lo, hi, whole)} (and `optional`
    fields, the same, checked when present), or None."""
    if not isinstance(r, dict):
        return f"{type(r).__name__} instead of an object"
    for name, (lo, hi, whole) in {**fields, **{k: v for k, v in (optional or {}).items() if k in r}}.items():
        x = r.get(name)
        if not _number(x, lo, hi) or (whole and not isinstance(x, int)):
            kind = "a whole number" if whole else "a number"
            return f"'{name}' {_show.repr(x)} is not {kind} from {_fmt(lo)} to {_fmt(hi)}"
    return None


_ATTENTION = {"tokens": (1, MAX_TOKENS, False), "gflops": (MIN_GFLOPS, MAX_GFLOPS, False)}
_GEMM = {"n": (1, MAX_GEMM_N, True), "gflops": (MIN_GFLOPS, MAX_GFLOPS, False)}
_GEMM_OPTIONAL = {"m": (1, MAX_GEMM_N, True), "k": (1, MAX_GEMM_N, True)}
_ELEMENTWISE = {"gbps": (MIN_GBPS, MAX_GBPS, False)}


def validate(data) -> Optional[str]:
    """None when `data` is a usable calibration (every field the estimate reads within the ranges above), else
    what is wrong with it (the first problem found)."""
    if not isinstance(data, dict):
        return "not a JSON object"
    version = data.get("version")
    if not any(_number(version, v, v) for v in KINDS):  # a JSON number (1.0 is 1), not true
        return f"version {_show.repr(version)} is not {' or '.join(map(str, KINDS))}"
    version = int(version)
    for key in ("device", "date", "dtype") + (("torch_default",) if "torch_default" in data else ()):
        text = data.get(key)
        if not isinstance(text, str) or not text:
            return f"'{key}' is missing or not a string"
        if len(text) > MAX_TEXT or not text.isprintable():
            return f"'{key}' is not one line of printable text of at most {MAX_TEXT} characters"
    if "upgraded_from" in data and (version != VERSION or not _number(data["upgraded_from"], 1, 1)):
        return f"'upgraded_from' {_show.repr(data['upgraded_from'])} is not 1 in a version {VERSION} calibration"
    att = data.get("attention")
    if not isinstance(att, dict) or not isinstance(att.get("pack"), list) or not att["pack"]:
        return "'attention' has no 'pack' measurements"
    for kind, rows in att.items():
        if kind not in KINDS[version] or not isinstance(rows, list):
            return f"attention kind {_show.repr(kind)} is unknown or not a list"
        for i, r in enumerate(rows):
            bad = _entry(r, _ATTENTION)
            if bad:
                return f"attention entry {i} of {kind!r}: {bad}"
    gemm = data.get("gemm")
    if not isinstance(gemm, list) or not gemm:
        return "'gemm' needs a non-empty list of measurements"
    for i, r in enumerate(gemm):
        bad = _entry(r, _GEMM, _GEMM_OPTIONAL)
        if bad:
            return f"gemm entry {i}: {bad}"
    if "elementwise" in data:
        ew = data["elementwise"]
        if not isinstance(ew, list) or not ew:
            return "'elementwise' is not a non-empty list of measurements"
        for i, r in enumerate(ew):
            bad = _entry(r, _ELEMENTWISE)
            if bad:
                return f"elementwise entry {i}: {bad}"
    if "load" in data and load_problem(data["load"]):  # optional: the load calibrate measured at
        return f"'load' {load_problem(data['load'])}"
    return None


def upgraded(data: dict) -> dict:
    """A valid calibration in version VERSION's terms: a version 1 file's mislabelled "math" rate (torch's
    default SDPA) becomes "torch" (backend unknown), it has no math SDPA rate, and "upgraded_from": 1 marks it;
    a current file as it is."""
    if int(data["version"]) != 1:
        return data
    att = dict(data["attention"])
    if "math" in att:
        att["torch"] = att.pop("math")
    return {**data, "version": VERSION, "attention": att, "upgraded_from": 1}


def note(calib: dict) -> Optional[str]:
    """What a reader of `calib`'s rates must know about them (V1_NOTE for an upgraded version 1 file), or None."""
    return V1_NOTE if calib.get("upgraded_from") == 1 else None


def kind_note(calib: dict, kind: str) -> str:
    """The text after a printed line of `kind`'s attention rates: what "math" and "torch" measured."""
    if kind == "math":
        return " (math SDPA: sdpa_kernel(SDPBackend.MATH))"
    if kind == "torch":
        backend = "unknown: " + V1_NOTE if note(calib) else calib.get("torch_default", "unknown")
        return f" (torch's default SDPA, backend {backend})"
    return ""


def _checked(data):
    bad = validate(data)
    return (None, [bad]) if bad else (upgraded(data), [])


_cache: dict = {}


def load(path: str) -> Optional[dict]:
    """The calibration at `path`, or None when there is none or it is unusable (one warning naming the file,
    once per version of it: the Attention Fit node asks on every run)."""
    return jsonfile.load_json_validated(path, _checked, _cache, what="calibration",
                                        hint="Run python -m attention_core.calibrate again.")


def problem(path: str) -> Optional[str]:
    """Why the calibration file at `path` is not usable (unreadable, not JSON, out of range...), or None when it
    is usable or does not exist; no warning logged (for a command line's `error:` line)."""
    key, value, problems = jsonfile.read_json_validated(path, _checked)
    if key is None or value is not None:
        return None
    return f"{path!r} is not a usable calibration: {'; '.join(problems)}"


def save(data: dict, path: str) -> str:
    """Write atomically (jsonfile.atomic_write_json: a unique temporary file in the same folder, then os.replace)."""
    bad = validate(data)
    if bad:
        raise ValueError(f"not saving an invalid calibration to {path}: {bad}")
    return jsonfile.atomic_write_json(path, data)

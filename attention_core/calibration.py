"""The calibration file of attention_core.calibrate: where it lives, validation on load, atomic writes.

Untrusted input (a file on the user's disk): `load` validates it and treats a bad one as absent, with one warning
naming the file; `save` writes a unique temporary file (tempfile.mkstemp) in the same folder and renames it over
the old one (os.replace), so readers and other writers never see a partial file. No torch import here.
"""
from __future__ import annotations

import math
import os
import re
from typing import Optional

from . import jsonfile
from .machine_load import load_problem

VERSION = 1
KINDS = ("pack", "subquad", "math")


def calibration_path(device: str = "cpu", dtype: str = "fp32") -> str:
    """calibration-<device name>-<dtype>.json: the first that exists in profiles.profile_dirs() (ComfyUI's user
    folder, then where a shell's calibrate writes), else where this process would write it."""
    from .profiles import _device_name, find_profile_file
    name, arch = _device_name(device)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", f"{name}-{arch}").strip("-").lower()[:80] or "device"
    return find_profile_file(f"calibration-{slug}-{dtype}.json")


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def validate(data) -> Optional[str]:
    """None when `data` is a usable calibration, else what is wrong with it."""
    if not isinstance(data, dict):
        return "not a JSON object"
    if data.get("version") != VERSION:
        return f"version {data.get('version')!r} is not {VERSION}"
    for key in ("device", "date", "dtype"):
        if not isinstance(data.get(key), str) or not data[key]:
            return f"'{key}' is missing or not a string"
    att = data.get("attention")
    if not isinstance(att, dict) or not isinstance(att.get("pack"), list) or not att["pack"]:
        return "'attention' has no 'pack' measurements"
    for kind, rows in att.items():
        if kind not in KINDS or not isinstance(rows, list):
            return f"attention kind {kind!r} is unknown or not a list"
        for r in rows:
            if not (isinstance(r, dict) and all(_positive(r.get(k)) for k in ("tokens", "gflops"))):
                return f"an attention entry of {kind!r} needs positive 'tokens' and 'gflops': {r!r}"
    gemm = data.get("gemm")
    if not (isinstance(gemm, list) and gemm and all(isinstance(r, dict) and _positive(r.get("gflops"))
                                                     for r in gemm)):
        return "'gemm' needs a list of entries with positive 'gflops'"
    if "load" in data and load_problem(data["load"]):  # optional: the load calibrate measured at
        return f"'load' {load_problem(data['load'])}"
    return None


def _checked(data):
    bad = validate(data)
    return (None, [bad]) if bad else (data, [])


def load(path: str) -> Optional[dict]:
    """The calibration at `path`, or None when there is none or it is unusable (one warning naming the file)."""
    return jsonfile.load_json_validated(path, _checked, what="calibration",
                                        hint="Run python -m attention_core.calibrate again.")


def save(data: dict, path: str) -> str:
    """Write atomically (jsonfile.atomic_write_json: a unique temporary file in the same folder, then os.replace)."""
    bad = validate(data)
    if bad:
        raise ValueError(f"not saving an invalid calibration to {path}: {bad}")
    return jsonfile.atomic_write_json(path, data)

"""Per-device tile profiles: where they live, loading and saving them, and the planner's question `tuned_blocks`.

A profile is JSON, one file per device name, arch and torch version, looked for in ComfyUI's user directory
(<user>/tiled-attention/) when running inside ComfyUI, then in $TILED_ATTENTION_PROFILE_DIR if set, else in
~/.cache/tiled-attention/ (profile_dirs: a profile tuned from a shell is found inside ComfyUI too). `python -m attention_core.tune` writes them (timing needs the engine; this module does
not, so the driver can ask it without an import circle).

`tuned_blocks(...)`: the profile's tile for the nearest tuned shape (same tier, dtype and head dim, key and head
counts within 2x of the tuned ones), rows rescaled so the tile keeps its tuned number of scores at another key
count, or None when there is no profile, TILED_ATTENTION_TUNE=off, or the tile would exceed the memory budget.

A profile is a file on the user's disk, so it is untrusted input: `load_profile` validates it (entries of the wrong
shape or type, unknown tiers, counts outside [1, MAX_COUNT] are dropped, with ONE warning naming the file per
version of it; a file that is not a profile at all, or not readable as JSON whatever it holds, is ignored the same
way: attention_core.device.jsonfile), tiles are clamped to [1, N] where they are used, and
`save_profile` writes atomically under a unique temporary name (attention_core.device.jsonfile), so concurrent tuners
never collide and readers never see a partial file. No attention call fails because of a profile.
"""
from __future__ import annotations

import logging
import math
import os
import platform
import re
import reprlib
import sys
from typing import Optional, Tuple

from .jsonfile import atomic_write_json, load_json_validated
from .machine_load import load_problem
from .tile_bytes import tile_bytes_per_score

log = logging.getLogger(__name__)

PROFILE_VERSION = 1
ENV_DIR = "TILED_ATTENTION_PROFILE_DIR"
ENV_SWITCH = "TILED_ATTENTION_TUNE"      # "off": never use a profile
ENV_LAYOUT = "TILED_ATTENTION_LAYOUT"    # "queries" / "keys": force the chunked tier's score layout
LAYOUTS = ("queries", "keys")            # the chunked tier's score layouts (tiers.chunked.LAYOUTS; no import)
# score layout without a profile entry, by device kind: measured on the CPU (docs/bench-tiles-cpu.log); GPUs
# keep the layout the engine always had until `tune` measures them
DEFAULT_LAYOUT = {"cpu": "queries", "other": "queries"}
MIN_ROWS = 16
_cache: dict = {}
_warned_layouts: set = set()


# ------------------------------------------------------------------------------------------- where it lives
def _device_name(device) -> Tuple[str, str]:
    """(name, arch) of a torch device: the GPU's name and gfx arch / SM, or the CPU model and machine."""
    import torch
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        arch = getattr(props, "gcnArchName", None) or f"sm_{props.major}{props.minor}"
        return props.name, arch.split(":")[0]
    name = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return name or "cpu", platform.machine() or "cpu"


def profile_dirs() -> list:
    """Where profiles and calibrations are looked for, in order; the first is where this process writes them:
    ComfyUI's user directory/tiled-attention when ComfyUI is running in this process, then
    $TILED_ATTENTION_PROFILE_DIR if set, else the per-user cache (~/.cache/tiled-attention or
    $XDG_CACHE_HOME/tiled-attention) -- so what `python -m attention_core.tune` / `calibrate` saved from a shell
    is found inside ComfyUI too, unless ComfyUI's user directory holds a file of the same name."""
    dirs = []
    fp = sys.modules.get("folder_paths")
    if fp is not None and hasattr(fp, "get_user_directory"):
        try:
            dirs.append(os.path.join(fp.get_user_directory(), "tiled-attention"))
        except Exception:  # noqa: BLE001 - a ComfyUI without a user directory: fall back
            pass
    if os.environ.get(ENV_DIR):
        dirs.append(os.environ[ENV_DIR])
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        dirs.append(os.path.join(base, "tiled-attention"))
    return list(dict.fromkeys(dirs))


def profile_dir() -> str:
    """The folder this process writes profiles and calibrations to (profile_dirs()[0])."""
    return profile_dirs()[0]


def find_profile_file(name: str) -> str:
    """The first `name` that exists in profile_dirs(), else where it would be written (in profile_dir())."""
    for d in profile_dirs():
        path = os.path.join(d, name)
        if os.path.isfile(path):
            return path
    return os.path.join(profile_dir(), name)


def profile_name(device="cpu") -> str:
    """The file name of `device`'s profile: keyed by device name, arch and torch version."""
    import torch
    name, arch = _device_name(device)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", f"{name}-{arch}-torch{torch.__version__}").strip("-").lower()
    return f"{slug}.json"


def profile_path(device="cpu") -> str:
    """The profile `auto` reads for `device`: the first in profile_dirs() that exists, else where tune writes."""
    return find_profile_file(profile_name(device))


TIER_NAMES = ("chunked", "inplace", "online")  # the forward tiers a profile may name (tiers.ORDER; no import)
_COUNTS = ("heads", "dim", "n", "block_q", "block_kv", "heads_per_group")
# the largest count a profile entry may hold: 2^31 - 1 keys, heads, head dims or tile sizes is far beyond any
# shape `tune` measures (thousands of keys, tens of heads), and it keeps every ratio the planner takes
# (log(n / Lk), rows x n / Lk) within float range: a 400-digit count overflowed float division on every call
MAX_COUNT = 2 ** 31 - 1
_show = reprlib.Repr()
_show.maxstring, _show.maxother, _show.maxlong = 40, 40, 40


def _entry_problem(e) -> Optional[str]:
    """Why a profile entry is unusable, or None when it is a valid entry."""
    if not isinstance(e, dict):
        return f"{type(e).__name__} instead of an object"
    if not isinstance(e.get("tier"), str) or e["tier"] not in TIER_NAMES:
        return f"tier {_show.repr(e.get('tier'))} is not one of {', '.join(TIER_NAMES)}"
    if not isinstance(e.get("dtype"), str):
        return f"dtype {_show.repr(e.get('dtype'))} is not a dtype name"
    for key in _COUNTS:
        val = e.get(key)
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            return f"{key} {_show.repr(val)} is not an integer >= 1"
        if val > MAX_COUNT:
            return f"{key} {_show.repr(val)} is larger than {MAX_COUNT:,}"
    if not isinstance(e.get("use", True), bool):
        return f"use {_show.repr(e.get('use'))} is not true/false"
    return None


def validate_profile(obj) -> Tuple[Optional[dict], list]:
    """(profile with only its valid entries, or None; the problems found), for jsonfile.load_json_validated."""
    if not isinstance(obj, dict):
        return None, [f"a JSON {type(obj).__name__}, not a profile object"]
    version = obj.get("version")
    if isinstance(version, bool) or not isinstance(version, (int, float)) or version != PROFILE_VERSION:
        return None, [f"version {_show.repr(version)}, this engine reads version {PROFILE_VERSION}"]
    entries = obj.get("entries")
    if not isinstance(entries, list):
        return None, [f"'entries' is {type(entries).__name__}, not a list"]
    good, problems = [], []
    for i, e in enumerate(entries):
        why = _entry_problem(e)
        if why is None:
            good.append(e)
        else:
            problems.append(f"entry {i}: {why}")
    if problems:
        problems.insert(0, f"{len(problems)} of {len(entries)} entries dropped")
    out = dict(obj, entries=good)
    if "layouts" in obj:
        out["layouts"], bad = _valid_layouts(obj["layouts"])
        problems += bad
    if "load" in obj:  # optional: the load `tune` measured at (machine_load.summary); a bad one is dropped
        why = load_problem(obj["load"])
        if why:
            del out["load"]
            problems.append(f"'load' {why}; dropped")
    return out, problems


def _valid_layouts(layouts) -> Tuple[dict, list]:
    """({dtype name: score layout} with only valid pairs, problems): the profile's per-dtype chunked layout."""
    if not isinstance(layouts, dict):
        return {}, [f"'layouts' is {type(layouts).__name__}, not an object of dtype: layout; ignored"]
    good, problems = {}, []
    for dt, lay in layouts.items():
        if isinstance(lay, str) and lay in LAYOUTS:
            good[dt] = lay
        else:
            problems.append(f"layouts[{_show.repr(dt)}] {_show.repr(lay)} is not one of {', '.join(LAYOUTS)}; "
                            "dropped")
    return good, problems


def load_profile(device="cpu") -> Optional[dict]:
    """The saved profile of `device` with only its valid entries (re-read when the file changes), or None when
    there is none or it is not a profile. Never raises for a bad file; warns once per version of it."""
    return load_json_validated(profile_path(device), validate_profile, _cache, what="tuned profile",
                               hint="Re-run `python -m attention_core.tune` to rewrite it, or delete it.")


# ------------------------------------------------------------------------------------------ the planner hook
def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def bytes_per_score(tier: str, dtype, device="cpu") -> int:
    """memory.bytes_per_score of a tile without mask or dropout, from the tier, dtype and device alone: the CPU
    computes half inputs in fp32 (numerics' "auto"); elsewhere fp16 stays fp16 (with its overflow guard) and bf16
    may compute in bf16 or fp32, counted at the larger of the two."""
    import torch
    name = _dtype_name(dtype)
    kind = "cpu" if torch.device(device).type == "cpu" else "other"
    tier = tier if tier in ("chunked", "inplace") else "online"
    if name == "float64":
        options = [(8, False)]
    elif kind == "cpu" or name not in ("float16", "bfloat16"):
        options = [(4, False)]
    elif name == "float16":
        options = [(2, True)]
    else:
        options = [(2, False), (4, False)]
    return max(tile_bytes_per_score(tier, size, fp16, kind) for size, fp16 in options)


NEAR = 2.0  # a tuned tile serves key and head counts within this factor of the tuned ones; others: engine's plan


def _nearest(entries, heads: int, n: int) -> Optional[dict]:
    """The valid entry nearest (n keys, heads) within NEAR of both, or None (entries that skipped validation and
    are not valid are passed over here too)."""
    heads, n = max(1, heads), max(1, n)
    entries = [e for e in entries if _entry_problem(e) is None
               and abs(math.log(e["n"] / n)) <= math.log(NEAR) + 1e-9
               and abs(math.log(e["heads"] / heads)) <= math.log(NEAR) + 1e-9]
    if not entries:
        return None
    return min(entries, key=lambda e: abs(math.log(e["n"] / n)) + abs(math.log(e["heads"] / heads)))


def _matching(prof: dict, dtype, tier: str, D: int) -> list:
    return [e for e in prof.get("entries", []) if isinstance(e, dict) and e.get("dtype") == _dtype_name(dtype)
            and e.get("tier") == tier and e.get("dim") == D]


def tuned_blocks(device, dtype, heads: int, Lq: int, Lk: int, D: int, tier: str, budget: int,
                 groups: int = 1, per_score: Optional[int] = None) -> Optional[Tuple[int, int, int]]:
    """(block_q, block_kv, heads_per_group) from this device's profile for a call of `heads` kv heads (each with
    `groups` = batch x GQA group rows per query row) of Lq queries, Lk keys, head dim D; None when there is no
    profile entry, TILED_ATTENTION_TUNE=off, or the tile would not fit `budget` bytes at `per_score` bytes a
    score (the planner's memory.bytes_per_score; default: this tier's cost without mask or dropout).

    The tuned tile keeps its number of scores: rows = tuned rows x tuned keys / Lk (chunked and inplace use
    full key rows), at least 16; every size within [1, Lq], [1, Lk], [1, heads] (tuned_blocks_for)."""
    if os.environ.get(ENV_SWITCH, "").lower() in ("off", "0", "false", "no"):
        return None
    prof = load_profile(device)
    if prof is None:
        return None
    e = _nearest(_matching(prof, dtype, tier, D), heads, Lk)
    if e is None or not e.get("use", True):  # the engine's own plan was as fast there: keep it
        return None
    bq, bkv, hpg = tuned_blocks_for(e, heads, Lq, Lk)
    if (per_score or bytes_per_score(tier, dtype, device)) * groups * bq * bkv * hpg > budget:
        return None
    return bq, bkv, hpg


def _within(x, hi: int) -> int:
    """x clamped to [1, hi] (hi < 1 counts as 1; a non-integer as 1)."""
    x = x if isinstance(x, int) and not isinstance(x, bool) else 1
    return max(1, min(max(1, hi), x))


def tuned_blocks_for(entry: dict, heads: int, Lq: int, Lk: int) -> Tuple[int, int, int]:
    """An entry's tile applied to another shape (the same rescaling as tuned_blocks, no budget check), each size
    clamped to [1, N] of its dimension whatever the entry holds."""
    hpg, tuned_heads = entry.get("heads_per_group"), entry.get("heads")
    hpg = _within(hpg if isinstance(hpg, int) and isinstance(tuned_heads, int) and hpg < tuned_heads else heads,
                  heads)
    bq = entry.get("block_q") if isinstance(entry.get("block_q"), int) else 1
    if entry.get("tier") == "online":
        return _within(bq, Lq), _within(entry.get("block_kv"), Lk), hpg
    n = entry.get("n") if isinstance(entry.get("n"), int) and entry.get("n") > 0 else max(1, Lk)
    return _within(max(MIN_ROWS, bq * n // max(1, Lk)), Lq), max(1, Lk), hpg


def score_layout(device, dtype) -> str:
    """The chunked tier's score layout ("queries" or "keys") for `dtype` on `device`: $TILED_ATTENTION_LAYOUT when
    it names one, else the profile's measured layout for the dtype (not with TILED_ATTENTION_TUNE=off), else
    DEFAULT_LAYOUT of the device kind."""
    import torch
    env = os.environ.get(ENV_LAYOUT, "").strip().lower()
    if env in LAYOUTS:
        return env
    if env and env not in _warned_layouts:  # a typo must not pass silently (once per value)
        _warned_layouts.add(env)
        log.warning("tiled attention: ignoring %s=%r: expected one of %s", ENV_LAYOUT, env, ", ".join(LAYOUTS))
    if os.environ.get(ENV_SWITCH, "").lower() not in ("off", "0", "false", "no"):
        prof = load_profile(device)
        lay = (prof or {}).get("layouts", {}).get(_dtype_name(dtype))
        if lay in LAYOUTS:
            return lay
    return DEFAULT_LAYOUT["cpu" if torch.device(device).type == "cpu" else "other"]


def lookup(q_shape, dtype, device="cpu", tier="chunked") -> Optional[dict]:
    """The profile entry nearest a [B, H, N, D] call (also one whose tile lost to the engine's plan), or None."""
    prof = load_profile(device)
    if prof is None:
        return None
    B, H, N, D = q_shape
    return _nearest(_matching(prof, dtype, tier, D), H, N)



def save_profile(prof: dict, device="cpu", path: Optional[str] = None) -> str:
    """Write `prof` to `path` (default: this device's profile path) atomically; the path."""
    path = atomic_write_json(path or os.path.join(profile_dir(), profile_name(device)), prof)
    _cache.pop(path, None)
    return path

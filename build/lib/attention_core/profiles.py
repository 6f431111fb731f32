"""Per-device tile profiles: where they live, loading and saving them, and the planner's question `tuned_blocks`.

A profile is JSON, one file per device name, arch and torch version, in ComfyUI's user directory
(<user>/tiled-attention/) when running inside ComfyUI, else $TILED_ATTENTION_PROFILE_DIR, else
~/.cache/tiled-attention/. `python -m attention_core.tune` writes them (timing needs the engine; this module does
not, so the driver can ask it without an import circle).

`tuned_blocks(...)`: the profile's tile for the nearest tuned shape (same tier, dtype and head dim, key and head
counts within 2x of the tuned ones), rows rescaled so the tile keeps its tuned number of scores at another key
count, or None when there is no profile, TILED_ATTENTION_TUNE=off, or the tile would exceed the memory budget.
"""
from __future__ import annotations

import json
import math
import os
import platform
import re
import sys
from typing import Optional, Tuple

PROFILE_VERSION = 1
ENV_DIR = "TILED_ATTENTION_PROFILE_DIR"
ENV_SWITCH = "TILED_ATTENTION_TUNE"      # "off": never use a profile
MIN_ROWS = 16
# transient bytes per score of a tile, as attention_core.memory.bytes_per_score counts them (fp16 tiles at 4:
# the overflow guard may recompute one in fp32)
_BPS = {"chunked": 2, "inplace": 1, "online": 3}
_cache: dict = {}


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


def profile_dir() -> str:
    """ComfyUI's user directory when ComfyUI is running in this process, else $TILED_ATTENTION_PROFILE_DIR, else
    the per-user cache (~/.cache/tiled-attention or $XDG_CACHE_HOME/tiled-attention)."""
    fp = sys.modules.get("folder_paths")
    if fp is not None and hasattr(fp, "get_user_directory"):
        try:
            return os.path.join(fp.get_user_directory(), "tiled-attention")
        except Exception:  # noqa: BLE001 - a ComfyUI without a user directory: fall back
            pass
    if os.environ.get(ENV_DIR):
        return os.environ[ENV_DIR]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tiled-attention")


def profile_path(device="cpu") -> str:
    """The profile file of `device`: keyed by device name, arch and torch version."""
    import torch
    name, arch = _device_name(device)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", f"{name}-{arch}-torch{torch.__version__}").strip("-").lower()
    return os.path.join(profile_dir(), f"{slug}.json")


def load_profile(device="cpu") -> Optional[dict]:
    """The saved profile of `device` (re-read when the file changes), or None."""
    path = profile_path(device)
    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        return None
    hit = _cache.get(path)
    if hit and hit[0] == mtime:
        return hit[1]
    try:
        with open(path) as f:
            prof = json.load(f)
    except (OSError, ValueError):
        return None
    if prof.get("version") != PROFILE_VERSION:
        return None
    _cache[path] = (mtime, prof)
    return prof


# ------------------------------------------------------------------------------------------ the planner hook
def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def bytes_per_score(tier: str, dtype) -> int:
    elem = 4 if _dtype_name(dtype) in ("float16", "bfloat16", "float32") else 8
    return _BPS.get(tier, 3) * elem


NEAR = 2.0  # a tuned tile serves key and head counts within this factor of the tuned ones; others: engine's plan


def _nearest(entries, heads: int, n: int) -> Optional[dict]:
    entries = [e for e in entries if abs(math.log(e["n"] / max(1, n))) <= math.log(NEAR) + 1e-9
               and abs(math.log(e["heads"] / max(1, heads))) <= math.log(NEAR) + 1e-9]
    if not entries:
        return None
    return min(entries, key=lambda e: abs(math.log(e["n"] / n)) + abs(math.log(e["heads"] / heads)))


def tuned_blocks(device, dtype, heads: int, Lq: int, Lk: int, D: int, tier: str, budget: int,
                 groups: int = 1, per_score: Optional[int] = None) -> Optional[Tuple[int, int, int]]:
    """(block_q, block_kv, heads_per_group) from this device's profile for a call of `heads` kv heads (each with
    `groups` = batch x GQA group rows per query row) of Lq queries, Lk keys, head dim D; None when there is no
    profile entry, TILED_ATTENTION_TUNE=off, or the tile would not fit `budget` bytes at `per_score` bytes a
    score (the planner's memory.bytes_per_score; default: this tier's cost without mask or dropout).

    The tuned tile keeps its number of scores: rows = tuned rows x tuned keys / Lk (chunked and inplace use
    full key rows), at least 16."""
    if os.environ.get(ENV_SWITCH, "").lower() in ("off", "0", "false", "no"):
        return None
    prof = load_profile(device)
    if prof is None:
        return None
    entries = [e for e in prof.get("entries", []) if e["dtype"] == _dtype_name(dtype) and e["tier"] == tier
               and e["dim"] == D]
    e = _nearest(entries, heads, Lk)
    if e is None or not e.get("use", True):  # the engine's own plan was as fast there: keep it
        return None
    hpg = max(1, min(heads, e["heads_per_group"] if e["heads_per_group"] < e["heads"] else heads))
    if tier == "online":
        bkv = min(Lk, e["block_kv"])
        bq = min(Lq, e["block_q"])
    else:
        bkv = Lk
        bq = min(Lq, max(MIN_ROWS, e["block_q"] * e["n"] // max(1, Lk)))
    if (per_score or bytes_per_score(tier, dtype)) * groups * bq * bkv * hpg > budget:
        return None
    return bq, bkv, hpg


def tuned_blocks_for(entry: dict, heads: int, Lq: int, Lk: int) -> Tuple[int, int, int]:
    """An entry's tile applied to another shape (the same rescaling as tuned_blocks, no budget check)."""
    hpg = max(1, min(heads, entry["heads_per_group"] if entry["heads_per_group"] < entry["heads"] else heads))
    if entry["tier"] == "online":
        return min(Lq, entry["block_q"]), min(Lk, entry["block_kv"]), hpg
    return min(Lq, max(MIN_ROWS, entry["block_q"] * entry["n"] // max(1, Lk))), Lk, hpg


def lookup(q_shape, dtype, device="cpu", tier="chunked") -> Optional[dict]:
    """The profile entry nearest a [B, H, N, D] call (also one whose tile lost to the engine's plan), or None."""
    prof = load_profile(device)
    if prof is None:
        return None
    B, H, N, D = q_shape
    entries = [e for e in prof.get("entries", []) if e["dtype"] == _dtype_name(dtype) and e["tier"] == tier
               and e["dim"] == D]
    return _nearest(entries, H, N)



def save_profile(prof: dict, device="cpu", path: Optional[str] = None) -> str:
    path = path or profile_path(device)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(prof, f, indent=1)
    os.replace(tmp, path)
    _cache.pop(path, None)
    return path

"""Per-device tile profiles: time candidate tile shapes and head groupings here, save the fastest, reuse them.

    python -m attention_core.tune                       # this device's default dtype, the preset shapes
    python -m attention_core.tune --dtype float32,bfloat16 --tiers chunked,online --rows 1024

A candidate is (block_q rows, block_kv keys, heads per group). Each is timed on the first `--rows` query rows of
the shape against all its keys (the work per query row is the same for every row, so the ranking holds for the
whole call) and compared with the engine's own untuned plan on the same rows. The profile is JSON, one file per
device name, arch and torch version, in ComfyUI's user directory (<user>/tiled-attention/) when this runs inside
ComfyUI, else $TILED_ATTENTION_PROFILE_DIR, else ~/.cache/tiled-attention/.

The planner asks `tuned_blocks(...)`: the profile's tile for the nearest tuned shape (same tier, dtype and head
dim, key and head counts within 2x of the tuned ones), rows rescaled so the tile keeps its tuned number of scores at another key count, or None when there is no
profile, TILED_ATTENTION_TUNE=off, or the tile would exceed the memory budget.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import sys
import time
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


# --------------------------------------------------------------------------------------- running a candidate
def run_blocks(q, k, v, blocks, tier="chunked"):
    """Attention of [B, H, N, D] tensors with a given (block_q, block_kv, heads_per_group) through the public
    API: one call per head group, tiles forced by block_q / block_kv. `blocks` may be a profile entry."""
    import torch
    from .sdpa import scaled_dot_product_attention
    if isinstance(blocks, dict):
        tier = blocks.get("tier", tier)
        blocks = tuned_blocks_for(blocks, q.shape[1], q.shape[2], k.shape[2])
    bq, bkv, hpg = blocks
    H = q.shape[1]
    if hpg >= H:
        return scaled_dot_product_attention(q, k, v, tier=tier, block_q=bq, block_kv=bkv)
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    for h0 in range(0, H, hpg):
        h1 = min(H, h0 + hpg)
        out[:, h0:h1] = scaled_dot_product_attention(q[:, h0:h1], k[:, h0:h1], v[:, h0:h1], tier=tier,
                                                     block_q=bq, block_kv=bkv)
    return out


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


def candidates(tier: str, heads: int, n: int, rows: int):
    """(block_q, block_kv, heads per group) to try: head groups of 2, 4, 8 or all heads (one head per tile
    and 32-row tiles lost everywhere on the CPU), rows 64..512 (online:
    key blocks 512..4096), tiles between 2^16 and 2^24 scores."""
    groups = sorted({g for g in (2, 4, 8, heads) if g <= heads and heads % g == 0})
    out = []
    for hpg in groups:
        for bq in (64, 128, 256, 512):
            if bq > rows:
                continue
            for bkv in ((n,) if tier != "online" else (512, 1024, 2048, 4096)):
                if bkv > n and tier == "online":
                    continue
                elems = hpg * bq * bkv
                if (1 << 16) <= elems <= (1 << 24):
                    out.append((bq, bkv, hpg))
    return out


def _time(fn, repeats, warm=True):
    if warm:
        fn()  # lazy init, thread pools
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def tune_shape(heads, n, dim, dtype, device, tier, rows, repeats, log=print):
    """Time the engine's own plan and every candidate on the first `rows` query rows; the profile entry."""
    import torch
    from .sdpa import scaled_dot_product_attention
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    rows = min(rows, n)
    q = torch.randn(1, heads, rows, dim, generator=g).to(device, dt)
    k = torch.randn(1, heads, n, dim, generator=g).to(device, dt)
    v = torch.randn(1, heads, n, dim, generator=g).to(device, dt)

    def sync():
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    with torch.no_grad():
        def untuned():
            scaled_dot_product_attention(q, k, v, tier=tier)
            sync()
        base = _time(untuned, repeats)
        log(f"    engine's own plan:                  {1000 * base:8.1f} ms")
        best, best_t = None, float("inf")
        for c in candidates(tier, heads, n, rows):
            def f(c=c):
                run_blocks(q, k, v, c, tier)
                sync()
            try:
                t = _time(f, repeats, warm=False)  # the untuned run above warmed everything up
            except Exception as e:  # noqa: BLE001 - an out-of-memory candidate just loses
                log(f"    {c}: {e.__class__.__name__}")
                continue
            log(f"    block_q {c[0]:>4} x keys {c[1]:>5} x {c[2]:>2} heads: {1000 * t:8.1f} ms")
            if t < best_t:
                best, best_t = c, t
    log(f"  {tier:<8} {heads}x{dim} N={n} {dtype}: untuned {1000 * base:.0f} ms, best {best} "
        f"{1000 * best_t:.0f} ms on {rows} rows ({base / best_t:.2f}x)")
    return {"tier": tier, "dtype": dtype, "heads": heads, "dim": dim, "n": n, "rows_timed": rows,
            "block_q": best[0], "block_kv": best[1], "heads_per_group": best[2],
            "ms": 1000 * best_t, "untuned_ms": 1000 * base, "use": best_t < base}


def tune(device, dtypes, shapes, tiers, rows, repeats, log=print) -> dict:
    """Tune every (dtype, tier, shape); returns the profile (not saved)."""
    import torch
    name, arch = _device_name(device)
    prof = {"version": PROFILE_VERSION, "device": name, "arch": arch, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "entries": []}
    for dtype in dtypes:
        for tier in tiers:
            for heads, n, dim in shapes:
                prof["entries"].append(tune_shape(heads, n, dim, dtype, device, tier, rows, repeats, log))
    return prof


def save_profile(prof: dict, device="cpu", path: Optional[str] = None) -> str:
    path = path or profile_path(device)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(prof, f, indent=1)
    os.replace(tmp, path)
    _cache.pop(path, None)
    return path


def main(argv=None) -> int:
    from .plan import PRESETS, preset_shapes
    ap = argparse.ArgumentParser(prog="python -m attention_core.tune", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: the accelerator if any)")
    ap.add_argument("--dtype", default=None, help="comma separated (default float32 on the CPU, float16 on GPUs)")
    ap.add_argument("--presets", default="wan22-5b-480p,ltx23-22b-720p,reference",
                    help=f"shapes to tune (from: {', '.join(PRESETS)}); N above --max-n is scaled down to it")
    ap.add_argument("--max-n", type=int, default=8192, help="key count cap for speed (the tile is rescaled)")
    ap.add_argument("--tiers", default="chunked", help="comma separated: chunked,inplace,online")
    ap.add_argument("--rows", type=int, default=1024, help="query rows timed per candidate")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None, help="profile file (default: this device's profile path)")
    a = ap.parse_args(argv)
    import torch
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtypes = [d.strip() for d in (a.dtype or ("float32" if device == "cpu" else "float16")).split(",")]
    shapes = []
    for p in a.presets.split(","):
        for n, h, d in preset_shapes(p.strip()):
            if (h, min(n, a.max_n), d) not in shapes:
                shapes.append((h, min(n, a.max_n), d))
    print(f"# tuning {device} ({' / '.join(_device_name(device))}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, dtypes {dtypes}, shapes {shapes}", flush=True)
    prof = tune(device, dtypes, shapes, [t.strip() for t in a.tiers.split(",")], a.rows, a.repeats,
                log=lambda s: print(s, flush=True))
    path = save_profile(prof, device, a.out)
    print(f"saved {path}; tier 'auto' uses it (TILED_ATTENTION_TUNE=off to ignore it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

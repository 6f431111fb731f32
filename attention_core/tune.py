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

import os
import statistics
import sys
import time

from .profiles import PROFILE_VERSION, _device_name, profile_path, save_profile, tuned_blocks_for
from .sdpa import scaled_dot_product_attention


# --------------------------------------------------------------------------------------- running a candidate
def run_blocks(q, k, v, blocks, tier="chunked"):
    """Attention of [B, H, N, D] tensors with a given (block_q, block_kv, heads_per_group) through the public
    API: one call per head group, tiles forced by block_q / block_kv. `blocks` may be a profile entry."""
    import torch
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


def main(argv=None) -> int:
    from . import cli_args
    from .plan import PRESETS, TIERS, preset_shapes
    ap = cli_args.Parser(prog="python -m attention_core.tune", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", type=cli_args.device, default=None,
                    help="cpu, cuda, cuda:1 (default: the accelerator if any)")
    ap.add_argument("--dtype", type=cli_args.dtype_list, default=None,
                    help="comma separated (default float32 on the CPU, float16 on GPUs)")
    ap.add_argument("--presets", type=cli_args.choice_list(PRESETS, "presets"),
                    default="wan22-5b-480p,ltx23-22b-720p,reference",
                    help=f"shapes to tune (from: {', '.join(PRESETS)}); N above --max-n is scaled down to it")
    # candidates are 64..512 rows and >= 512 keys (online): fewer rows or keys would leave nothing to time
    ap.add_argument("--max-n", type=cli_args.int_range(512), default=8192,
                    help="key count cap for speed (the tile is rescaled), >= 512")
    ap.add_argument("--tiers", type=cli_args.choice_list(TIERS, "tiers"), default="chunked",
                    help="comma separated: chunked,inplace,online")
    ap.add_argument("--rows", type=cli_args.int_range(64), default=1024, help="query rows timed per candidate, >= 64")
    ap.add_argument("--repeats", type=cli_args.int_range(1, 1000), default=2)
    ap.add_argument("--out", type=cli_args.output_file, default=None,
                    help="profile file (default: this device's profile path, the only one tier 'auto' reads)")
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
    read = profile_path(device)
    if os.path.abspath(path) == os.path.abspath(read):
        print(f"saved {path}; tier 'auto' uses it outside ComfyUI (inside ComfyUI it reads <ComfyUI user "
              f"directory>/tiled-attention/{os.path.basename(read)}; TILED_ATTENTION_TUNE=off ignores profiles)")
    else:
        print(f"saved {path}; tier 'auto' does not read this path: it reads {read} (inside ComfyUI: <ComfyUI user "
              f"directory>/tiled-attention/{os.path.basename(read)}); copy the file there to use it")
    return 0


if __name__ == "__main__":
    sys.exit(main())

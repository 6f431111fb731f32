"""Per-device tile profiles: time candidate tile shapes and head groupings here, save the fastest, reuse them.

    python -m attention_core.tune                       # this device's default dtype, the preset shapes
    python -m attention_core.tune --dtype float32,bfloat16 --tiers chunked,online --rows 1024

A candidate is (block_q rows, block_kv keys, heads per group). Each is timed on the first `--rows` query rows of
the shape against all its keys (the work per query row is the same for every row, so the ranking holds for the
whole call) together with the engine's own untuned plan on the same rows. The profile keeps the SMALLEST tile
within TOLERANCE (3 %) of the fastest: a larger tile only where it buys measured speed, since tile memory is
what the engine adds to the model's. With the chunked tier it also times the score layouts (queries-major vs
keys-major, `layout_check`) and keeps the faster per dtype in the profile's "layouts". The profile is JSON, one file per
device name, arch and torch version, in ComfyUI's user directory (<user>/tiled-attention/) when this runs inside
ComfyUI, else $TILED_ATTENTION_PROFILE_DIR, else ~/.cache/tiled-attention/.

Every line a figure is on names the load it was timed at (other processes' runnable threads, "others", from
attention_core.device.machine_load), and the profile records the run's ("load"). When other processes kept the machine
busy (on average more than a quarter of the cores), the profile is not saved unless --force-busy.

The planner asks `tuned_blocks(...)`: the profile's tile for the nearest tuned shape (same tier, dtype and head
dim, key and head counts within 2x of the tuned ones), rows rescaled so the tile keeps its tuned number of scores at another key count, or None when there is no
profile, TILED_ATTENTION_TUNE=off, or the tile would exceed the memory budget.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

from ..device import machine_load
from ..device.sync import synchronize
from ..kernel.memory import forward_block_kv, forward_tile, tile_budget
from ..kernel.oom import is_oom, release_cached
from ..device.profiles import (PROFILE_VERSION, _device_name, bytes_per_score, profile_dir, profile_name, profile_path,
                       save_profile, tuned_blocks_for)
from ..sdpa import scaled_dot_product_attention

TOLERANCE = 0.03  # a tile within 3 % of the fastest counts as fast; the smallest of those is kept
LAYOUT_ROUNDS = 4  # interleaved rounds per shape when tuning the chunked tier's score layout


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


def _only_out_of_memory(e: BaseException, device) -> None:
    """Re-raise `e` unless it is out of memory (oom.is_oom); after out of memory, give cached memory back."""
    if not is_oom(e):
        raise e
    import torch
    release_cached(torch.device(device))


def _time(fn, repeats, warm=True):
    if warm:
        fn()  # lazy init, thread pools
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def engine_tile(heads, n, rows, dtype, device, tier, dim=None):
    """(block_q, block_kv, heads per group) the engine's own plan takes for `rows` query rows of the shape (heads of
    `dim` dims: memory.tile_for's head cap depends on it)."""
    import torch
    kind = "cpu" if torch.device(device).type == "cpu" else "other"
    t = forward_tile(rows, heads, 1, bytes_per_score(tier, dtype, device), tile_budget(torch.device(device)), n, kind,
                     tier, head_dim=dim)
    return t if t is not None else (rows, forward_block_kv(tier, n, kind), heads)


def choose(timed, tolerance=TOLERANCE):
    """The smallest tile (scores: rows x keys x heads) among those within `tolerance` of the fastest; ties: the
    faster. `timed`: [(tile, seconds)]."""
    fastest = min(t for _, t in timed)
    ok = [(c, t) for c, t in timed if t <= (1 + tolerance) * fastest]
    return min(ok, key=lambda ct: (ct[0][0] * ct[0][1] * ct[0][2], ct[1]))


class NoCandidateRan(RuntimeError):
    """Every candidate tile of a shape failed (out of memory, most likely)."""


def tune_shape(heads, n, dim, dtype, device, tier, rows, repeats, log=print):
    """Time the engine's own plan and every candidate on the first `rows` query rows; the profile entry: the
    smallest tile within TOLERANCE of the fastest (`use` false when that is the engine's own tile)."""
    import torch
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    rows = min(rows, n)
    q = torch.randn(1, heads, rows, dim, generator=g).to(device, dt)
    k = torch.randn(1, heads, n, dim, generator=g).to(device, dt)
    v = torch.randn(1, heads, n, dim, generator=g).to(device, dt)

    with torch.no_grad():
        def untuned():
            scaled_dot_product_attention(q, k, v, tier=tier)
            synchronize(device)
        base = _time(untuned, repeats)
        log(f"    engine's own plan:                  {1000 * base:8.1f} ms")
        timed = []
        for c in candidates(tier, heads, n, rows):
            def f(c=c):
                run_blocks(q, k, v, c, tier)
                synchronize(device)
            try:
                t = _time(f, repeats, warm=False)  # the untuned run above warmed everything up
            except Exception as e:  # noqa: BLE001 - an out-of-memory candidate just loses; anything else is a bug
                _only_out_of_memory(e, device)
                log(f"    {c}: {e.__class__.__name__} (out of memory)")
                continue
            log(f"    block_q {c[0]:>4} x keys {c[1]:>5} x {c[2]:>2} heads: {1000 * t:8.1f} ms")
            timed.append((c, t))
    if not timed:
        raise NoCandidateRan(f"no tile candidate ran for {tier} {heads}x{dim} N={n} {dtype} on {device}")
    own = tuple(engine_tile(heads, n, rows, dt, device, tier, dim))
    best, best_t = choose(timed)  # the candidate kept in the entry
    pick, pick_t = choose(timed + [(own, base)])  # the engine's own tile competes too: use = a candidate won
    use = pick != own or pick_t != base
    fastest = min(t for _, t in timed + [(own, base)])
    log(f"  {tier:<8} {heads}x{dim} N={n} {dtype}: untuned {own} {1000 * base:.0f} ms, fastest "
        f"{1000 * fastest:.0f} ms, kept {best} {1000 * best_t:.0f} ms on {rows} rows (smallest within "
        f"{100 * TOLERANCE:.0f} % of the fastest){'' if use else '; the engine own tile is as good: not used'}")
    return {"tier": tier, "dtype": dtype, "heads": heads, "dim": dim, "n": n, "rows_timed": rows,
            "block_q": best[0], "block_kv": best[1], "heads_per_group": best[2],
            "ms": 1000 * best_t, "untuned_ms": 1000 * base, "fastest_ms": 1000 * fastest, "use": use}


# ------------------------------------------------------------------------------------ score layout (measured)
def _chunked_loop(q, k, v, bq, keys_major):
    """The chunked tier's loop without masks: per query tile S, softmax, P @ V; queries-major S = Q K^T (K as a
    transposed view), or keys-major S^T = K Q^T (softmax over dim -2, P^T as a transposed view into P V)."""
    import torch
    H, rows, N = q.shape[1], q.shape[2], k.shape[2]
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    s_buf = torch.empty(H * N * bq, dtype=q.dtype, device=q.device)  # flat: a shorter last tile stays contiguous
    p_buf = torch.empty_like(s_buf)
    for i in range(0, rows, bq):
        qt = q[:, :, i:i + bq]
        b = qt.shape[2]
        if keys_major:
            s = torch.matmul(k, qt.transpose(-1, -2), out=s_buf[:H * N * b].view(1, H, N, b))
            p = torch.ops.aten._softmax.out(s, -2, False, out=p_buf[:H * N * b].view(1, H, N, b))
            out[:, :, i:i + b] = torch.matmul(p.transpose(-1, -2), v)
        else:
            s = torch.matmul(qt, k.transpose(-1, -2), out=s_buf[:H * N * b].view(1, H, b, N))
            p = torch.ops.aten._softmax.out(s, -1, False, out=p_buf[:H * N * b].view(1, H, b, N))
            out[:, :, i:i + b] = torch.matmul(p, v)
    return out


def layout_check(heads, n, dim, dtype, device, rows, rounds, log=print) -> dict:
    """Queries-major vs keys-major scores over the whole chunked loop (issue 18.4) on the engine's own tile for
    the first `rows` query rows of one head group, rounds interleaved (order alternating), medians. The engine
    computes the layout the profile names (`tune` stores the faster one; profiles.score_layout)."""
    import torch
    dt = getattr(torch, dtype)
    bq, _, hpg = engine_tile(heads, n, rows, dt, device, "chunked", dim)
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(1, hpg, rows, dim, generator=g) * dim ** -0.5).to(device, dt)
    k, v = (torch.randn(1, hpg, n, dim, generator=g).to(device, dt) for _ in range(2))

    with torch.no_grad():
        diff = float((_chunked_loop(q, k, v, bq, False) - _chunked_loop(q, k, v, bq, True)).abs().max())
        ts = {False: [], True: []}
        for r in range(rounds):
            for km in ((False, True) if r % 2 == 0 else (True, False)):
                t0 = time.perf_counter()
                _chunked_loop(q, k, v, bq, km)
                synchronize(device)
                ts[km].append(time.perf_counter() - t0)
    qm, km = statistics.median(ts[False]), statistics.median(ts[True])
    log(f"  layout {heads}x{dim} N={n} {dtype}, tile {bq} rows x {hpg} heads, {rows} rows, {rounds} rounds: "
        f"queries-major {1000 * qm:.1f} ms, keys-major {1000 * km:.1f} ms (keys-major {qm / km:.2f}x as fast; "
        f"per round {[round(a / b, 2) for a, b in zip(ts[False], ts[True])]}; max |diff| {diff:.1e})")
    return {"heads": heads, "n": n, "dim": dim, "dtype": dtype, "block_q": bq, "heads_per_group": hpg,
            "queries_major_ms": 1000 * qm, "keys_major_ms": 1000 * km}


def pick_layout(checks) -> str:
    """The score layout with the smaller total of median times over `checks` (layout_check results); ties keep
    queries-major, the layout of every other tier and of the backward."""
    qm = sum(c["queries_major_ms"] for c in checks)
    km = sum(c["keys_major_ms"] for c in checks)
    return "keys" if km < qm else "queries"


def tune(device, dtypes, shapes, tiers, rows, repeats, log=print) -> dict:
    """Tune every (dtype, tier, shape); with the chunked tier also its score layout per dtype (layout_check at
    every shape, LAYOUT_ROUNDS interleaved rounds, the faster total of medians kept in "layouts"); returns the
    profile (not saved)."""
    import torch
    name, arch = _device_name(device)
    prof = {"version": PROFILE_VERSION, "device": name, "arch": arch, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "entries": []}
    for dtype in dtypes:
        for tier in tiers:
            for heads, n, dim in shapes:
                try:
                    prof["entries"].append(tune_shape(heads, n, dim, dtype, device, tier, rows, repeats, log))
                except NoCandidateRan as e:  # e.g. every tile out of memory: this shape keeps the engine's rule
                    log(f"  skipped: {e}")
        if "chunked" in tiers:
            try:
                checks = [layout_check(heads, n, dim, dtype, device, min(rows, n), LAYOUT_ROUNDS, log)
                          for heads, n, dim in shapes]
            except Exception as e:  # noqa: BLE001 - out of memory keeps the default layout; anything else is a bug
                _only_out_of_memory(e, device)
                log(f"  chunked {dtype}: score layouts not compared ({e.__class__.__name__}: {e}); default kept")
            else:
                prof.setdefault("layouts", {})[dtype] = pick_layout(checks)
                log(f"  chunked {dtype}: score layout kept: {prof['layouts'][dtype]}-major")
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
    ap.add_argument("--layouts", type=cli_args.int_range(0, 1000), default=0, metavar="ROUNDS",
                    help="instead of tuning: time the chunked loop with queries-major vs keys-major scores over "
                         "this many interleaved rounds per shape and print the medians (nothing is saved)")
    ap.add_argument(machine_load.FORCE_FLAG, action="store_true",
                    help="save the profile even when other processes kept the machine busy while it measured (their "
                         "runnable threads above a quarter of the cores on average); the profile records the load")
    a = ap.parse_args(argv)
    import torch
    device = a.device or cli_args.default_device()
    dtypes = [d.strip() for d in (a.dtype or ("float32" if device == "cpu" else "float16")).split(",")]
    shapes = []
    for p in a.presets.split(","):
        for n, h, d in preset_shapes(p.strip()):
            if (h, min(n, a.max_n), d) not in shapes:
                shapes.append((h, min(n, a.max_n), d))
    target = a.out or os.path.join(profile_dir(), profile_name(device))  # where save_profile writes
    if a.out is None and not a.layouts:  # --out was checked as it was parsed; the default too, before minutes of work
        bad = cli_args.writable_path(target)
        if bad:
            cli_args.fail(ap, "--out", f"cannot write the default profile {target!r}: {bad}; pass --out FILE (or "
                                       "set TILED_ATTENTION_PROFILE_DIR)")
    print(f"# {'layouts on' if a.layouts else 'tuning'} {device} ({' / '.join(_device_name(device))}), torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads, dtypes {dtypes}, shapes {shapes}", flush=True)
    monitor = machine_load.Monitor(force=a.force_busy)

    def log(line):  # each line names the load since the line before: the figure it reports was timed in between
        print(f"{line}   ({monitor.lap().text()})", flush=True)
    with monitor:
        monitor.lap()
        if a.layouts:
            for dtype in dtypes:
                for heads, n, dim in shapes:
                    layout_check(heads, n, dim, dtype, device, min(a.rows, n), a.layouts, log=log)
        else:
            prof = tune(device, dtypes, shapes, [t.strip() for t in a.tiers.split(",")], a.rows, a.repeats, log=log)
    load = monitor.summary()
    print(f"measured at: {machine_load.describe(load)}", flush=True)
    if a.layouts:
        return 0
    if not prof["entries"]:
        print(f"error: no shape could be tuned on {device} (every candidate tile failed; see the lines above): "
              "nothing saved; try --rows smaller, --max-n smaller or fewer --presets", file=sys.stderr)
        return 1
    refused = machine_load.refusal(load, "the profile")
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        return 2
    prof["load"] = load
    try:
        path = save_profile(prof, device, target)
    except OSError as e:  # checked before tuning, so only a change since (the folder removed, a full disk)
        kept = cli_args.keep_elsewhere(json.dumps(prof, indent=1), os.path.basename(target))
        print(f"error: could not write {target!r} ({e.strerror or e})" + (f"; the profile is in {kept!r}: copy it "
              "there" if kept else ""), file=sys.stderr)
        return 2
    read = profile_path(device)
    if os.path.abspath(path) == os.path.abspath(read):
        print(f"saved {path}; tier 'auto' uses it, in ComfyUI too (unless <ComfyUI user directory>/tiled-attention/"
              f"{os.path.basename(read)} exists, which ComfyUI reads first; TILED_ATTENTION_TUNE=off ignores "
              "profiles)")
    else:
        print(f"saved {path}; tier 'auto' does not read this path: it reads {read} (inside ComfyUI first <ComfyUI "
              f"user directory>/tiled-attention/{os.path.basename(read)}); copy the file there to use it")
    return 0


if __name__ == "__main__":
    sys.exit(main())

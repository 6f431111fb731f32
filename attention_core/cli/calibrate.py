"""Device calibration: measured throughput of what a DiT sampling step does, for attention_core.estimate.

    python -m attention_core.calibrate [--device cpu] [--dtype fp32] [--model wan22-5b] [--comfyui PATH]

Measures on this device and dtype (about 40 s on a quiet 2-core CPU):
  pack      the engine's attention (tier auto, the pack's recommended setting) at a few token counts
  subquad   ComfyUI's sub-quadratic attention (its default without xformers / pytorch attention), same shapes
  math      torch's math SDPA (torch.nn.attention.sdpa_kernel(SDPBackend.MATH): what the GPUs this pack is
            for run, and what ComfyUI's pytorch attention runs there) at the shapes whose score matrix fits
            comfortably
  torch     torch's default SDPA (the backend torch picks: the fused flash kernel on CPUs and on GPUs that have
            one), only where that backend is not math SDPA (attention_core.device.torch_sdpa.default_backend);
            the file names the backend ("torch_default")
            (the attention methods in interleaved rounds, median of ROUNDS: each sees the same machine load, so a
            load that comes and goes ranks them as a run under it would; see `interleaved`)
  gemm      dense GEMMs at the model's linear-layer shapes (width x width, width x FFN width and FFN width x
            width), at 512 rows (the text side's rows) and 4,096 (a video's: the layers run N tokens x the batch)
  elementwise  memory-bound passes over a 4,096-token activation (LayerNorm, RMSNorm, the modulation's addcmul,
            the tanh GELU, a residual add): bytes read plus written over their time, GB/s
            (GEMMs and elementwise passes: the best of a few runs each; both methods share them)
and stores the rates (GFLOP/s; attention FLOPs = 4 * heads * N^2 * head_dim; elementwise GB/s) in calibration-<device>.json
next to the tile profiles (attention_core.device.profiles.profile_dir), with the date and the device name.
The file's rules (validated on load, atomic writes) are in attention_core.device.calibration.
Each rate is printed with the load it was measured at (other processes' runnable threads, "others", from
attention_core.device.machine_load) and the file records the run's ("load"); when other processes kept the machine busy
(on average more than a quarter of the cores) the rates are printed and the file is not written, unless
--force-busy.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import math
import os
import statistics
import sys
import time
from typing import Optional

from ..device import machine_load
from ..device.sync import synchronize
from ..device.torch_sdpa import default_backend, math_sdpa, torch_sdpa
from . import plan
from ..device.calibration import VERSION, calibration_path, kind_note, save

TOKENS = (1024, 2048, 4096)
HEADS = 8          # calibration heads (rates are per FLOP; 24 heads would only make it slower to measure)
# token rows of the calibration GEMMs: 512 (a text's 512 tokens, batch 1) and 4,096 (the video side: 2,340 to
# 8,580 rows at the demo's and the 480p workflow's sizes with CFG; the rate at 512 rows was above what the
# model's own layers reach)
GEMM_ROWS = (512, 4096)
ELEMENTWISE_ROWS = 4096  # token rows of the elementwise passes (an activation far larger than the caches)
# the passes timed, with the elements each reads plus writes per element of x (attention_core.estimate counts a
# block's passes the same way)
ELEMENTWISE_OPS = ("layer_norm", "rms_norm", "addcmul", "gelu", "add")
MATH_MAX_SCORES = 1 << 26
ROUNDS = 3         # interleaved rounds of the attention methods (at least; `repeats` when more)


# ------------------------------------------------------------------------------------------- measuring
def _timed(monitor, key, fn, repeats: int) -> float:
    """_best(fn, repeats), inside `monitor`'s span `key` (machine_load.Monitor) when there is a monitor."""
    if monitor is None:
        return _best(fn, repeats)
    with monitor.span(key):
        return _best(fn, repeats)


def interleaved(monitor, fns: dict, rounds: int) -> dict:
    """{key: median seconds} of the functions `fns` {key: fn}, each warmed up once, then timed in `rounds`
    interleaved rounds (one call of each per round), each call inside `monitor`'s span `key` when there is a
    monitor. Why: the methods a calibration ranks must see the same machine. Timed one after another (best of a
    few each), a load that came and went between them ranked the pack and sub-quadratic backwards (issue 24);
    interleaved, a load hits every method alike, and the median is what a long run of calls gets, where the best
    of a few is the luckiest moment."""
    for fn in fns.values():
        fn()
    times = {key: [] for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            with monitor.span(key) if monitor is not None else contextlib.nullcontext():
                t0 = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - t0)
    return {key: statistics.median(t) for key, t in times.items()}


def _best(fn, repeats: int) -> float:
    fn()  # warm-up (allocations, first-call dispatch)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def attention_flops(heads: int, n: int, head_dim: int, keys: Optional[int] = None) -> float:
    """QK^T and PV of one batch item: 2 GEMMs of 2 * heads * N * keys * head_dim FLOPs each."""
    return 4.0 * heads * n * (keys or n) * head_dim


def measure(device: str = "cpu", dtype: str = "fp32", model: str = "wan22-5b", tokens=TOKENS,
            comfyui: Optional[str] = None, repeats: int = 2, monitor=None) -> dict:
    """Measure the rates (see the module doc) and return the calibration dict (not saved). `monitor`: a started
    machine_load.Monitor; each rate's readings go to monitor.figures[(kind, tokens)] (GEMMs: ("gemm", n))."""
    import torch

    from ..device.profiles import _device_name
    from ..sdpa import scaled_dot_product_attention
    td = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    dev = torch.device(device)
    spec = plan.MODELS[model]
    d = spec.head_dim
    sync = functools.partial(synchronize, dev)
    subquad = None
    if comfyui:
        from .bench_methods import comfy_attention
        subquad = comfy_attention(comfyui, "comfy-subquad")
    att = {"pack": [], "subquad": [], "math": [], "torch": []}
    backends = set()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n in tokens:
            q, k, v = (torch.randn(1, HEADS, n, d, generator=g).to(dev, td) for _ in range(3))
            qc, kc, vc = (t.transpose(1, 2).reshape(1, n, HEADS * d) for t in (q, k, v))  # ComfyUI's [B, N, H*D]

            def pack():
                scaled_dot_product_attention(q, k, v)
                sync()

            def sq():
                subquad(qc, kc, vc, HEADS)
                sync()

            def mth():
                math_sdpa(q, k, v)  # torch's own (the builtin) on its math backend, even with the global patch on
                sync()

            def default():
                torch_sdpa(q, k, v)  # torch's own with the backend it picks
                sync()
            fns = {"pack": pack}
            if subquad is not None:
                fns["subquad"] = sq
            if HEADS * n * n <= MATH_MAX_SCORES:
                fns["math"] = mth
            backend = default_backend(q, k, v)
            if backend != "math":
                fns["torch"] = default
                backends.add(backend)
            seconds = interleaved(monitor, {(kind, n): fn for kind, fn in fns.items()}, max(ROUNDS, repeats))
            fl = attention_flops(HEADS, n, d)
            for kind in fns:
                att[kind].append({"tokens": n, "heads": HEADS, "head_dim": d, "gflops": fl / seconds[(kind, n)] / 1e9})
            del q, k, v, qc, kc, vc
        gemm = []
        for rows in GEMM_ROWS:
            for k_w, out_w in ((spec.width, spec.width), (spec.width, spec.ffn), (spec.ffn, spec.width)):
                x = torch.randn(rows, k_w, generator=g).to(dev, td)
                w = torch.randn(out_w, k_w, generator=g).to(dev, td)

                def mm():
                    torch.nn.functional.linear(x, w)
                    sync()
                fl = 2.0 * rows * k_w * out_w
                gemm.append({"m": rows, "k": k_w, "n": out_w,
                             "gflops": fl / _timed(monitor, ("gemm", rows, k_w, out_w), mm, repeats) / 1e9})
                del x, w
        elementwise = [measure_elementwise(torch, dev, td, ELEMENTWISE_ROWS, spec.width, g, sync, repeats,
                                           monitor)]
    name, arch = _device_name(device)
    return {"version": VERSION, "device": f"{name} ({arch})", "dtype": dtype, "model": model,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "attention": {k: v for k, v in att.items() if v}, "gemm": gemm, "elementwise": elementwise,
            **({"torch_default": ", ".join(sorted(backends))} if backends else {})}


def elementwise_ops(torch, x, y, scale, weight):
    """{name: (elements read plus written per element of x, the pass)} of ELEMENTWISE_OPS on x [rows, width]."""
    F = torch.nn.functional
    return {"layer_norm": (2, lambda: F.layer_norm(x, x.shape[-1:], eps=1e-6)),
            "rms_norm": (2, lambda: F.rms_norm(x, x.shape[-1:], weight, eps=1e-6)),
            "addcmul": (3, lambda: torch.addcmul(x, y, scale)),
            "gelu": (2, lambda: F.gelu(x, approximate="tanh")),
            "add": (3, lambda: x + y)}


def measure_elementwise(torch, dev, td, rows: int, width: int, g, sync, repeats: int, monitor=None) -> dict:
    """{"rows", "width", "gbps"}: the bytes ELEMENTWISE_OPS read and write on a [rows, width] activation over
    the sum of their best times (one span ("elementwise", rows) of `monitor`)."""
    x, y = (torch.randn(rows, width, generator=g).to(dev, td) for _ in range(2))
    scale, weight = (torch.randn(1, width, generator=g).to(dev, td) for _ in range(2))
    ops = elementwise_ops(torch, x, y, scale, weight[0])
    moved = seconds = 0.0
    with monitor.span(("elementwise", rows)) if monitor is not None else contextlib.nullcontext():
        for name in ELEMENTWISE_OPS:
            units, fn = ops[name]

            def run(fn=fn):
                fn()
                sync()
            seconds += _best(run, repeats)
            moved += units * x.numel() * x.element_size()
    return {"rows": rows, "width": width, "gbps": moved / seconds / 1e9}


def main(argv=None) -> int:
    from . import cli_args
    ap = cli_args.Parser(prog="python -m attention_core.calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", type=cli_args.device, default="cpu", help="torch device to measure (cpu, cuda, cuda:1)")
    ap.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default=None,
                    help="dtype to measure (default: fp32 on the CPU, fp16 on a GPU)")
    ap.add_argument("--model", choices=sorted(plan.MODELS),
                    default="wan22-5b", help="whose linear-layer shapes and head dim to measure")
    ap.add_argument("--comfyui", type=cli_args.comfyui_folder, default=None, help="ComfyUI folder for its sub-quadratic attention (default: "
                    "$COMFYUI_LATEST_PATH, $COMFYUI_PATH, else the one ./dev set up; none: skipped)")
    ap.add_argument("--out", type=cli_args.output_file, default=None, help="file to write (default: in the profile folder)")
    ap.add_argument(machine_load.FORCE_FLAG, action="store_true",
                    help="write the file even when other processes kept the machine busy while it measured (their "
                         "runnable threads above a quarter of the cores on average); the file records the load")
    a = ap.parse_args(argv)
    dtype = a.dtype or ("fp32" if a.device == "cpu" else "fp16")
    target = a.out or calibration_path(a.device, dtype)
    if a.out is None:  # --out was checked as it was parsed; the default path too, before a minute of measuring
        bad = cli_args.writable_path(target)
        if bad:
            cli_args.fail(ap, "--out", f"cannot write the default calibration file {target!r}: {bad}; pass --out "
                                       "FILE (or set TILED_ATTENTION_PROFILE_DIR)")
    from .bench import default_comfyui
    comfyui = a.comfyui or default_comfyui()
    monitor = machine_load.Monitor(force=a.force_busy)
    try:
        with monitor:
            data = measure(a.device, dtype, a.model, comfyui=comfyui, monitor=monitor)
    except (RuntimeError, ValueError) as e:
        print(f"error: --device {a.device} --dtype {dtype}: {e}", file=sys.stderr)
        return 2
    data["load"] = load = monitor.summary()
    refused = machine_load.refusal(load, "the calibration")
    path = failed = None
    if not refused:
        try:
            path = save(data, target)
        except OSError as e:  # checked before measuring, so only a change since (the folder removed, a full disk)
            kept = cli_args.keep_elsewhere(json.dumps(data, indent=1), os.path.basename(target))
            failed = (f"could not write {target!r} ({e.strerror or e})" + (f"; the calibration is in {kept!r}: "
                      f"copy it there" if kept else ""))

    def rate(key, text, gflops):  # a rate, with the load it was measured at when known
        span = monitor.figures.get(key)
        return f"{text}: {gflops:.1f}" + (f" ({span.text()})" if span is not None else "")
    print(f"calibration of {data['device']}, {dtype}, {data['date']} -> {path or 'not saved'}")
    for kind, rows in data["attention"].items():
        print(f"  attention {kind:<8} " + ", ".join(rate((kind, r["tokens"]), f"N {r['tokens']}", r["gflops"])
                                                   for r in rows) + " GFLOP/s" + kind_note(data, kind))
    print("  GEMM               " + ", ".join(rate(("gemm", r["m"], r["k"], r["n"]), f"{r['m']}x{r['k']}x{r['n']}",
                                                   r["gflops"]) for r in data["gemm"]) + " GFLOP/s")
    for r in data.get("elementwise", ()):
        print("  elementwise        " + rate(("elementwise", r["rows"]), f"{r['rows']}x{r['width']}", r["gbps"])
              + " GB/s")
    if not comfyui:
        print("  (ComfyUI not found: sub-quadratic not measured; pass --comfyui PATH)")
    print(f"  measured at: {machine_load.describe(load)}")
    if refused or failed:
        print(f"error: {refused or failed}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Model benchmarks of `python -m attention_core.bench --preset NAME`: a real model's attention and steps, this
engine side by side with torch's math SDPA, torch's default and (images) ComfyUI's sub-quadratic attention.

    python -m attention_core.bench --preset zimage-turbo                 # attention at 512-2048 px, a DiT step
    python -m attention_core.bench --preset qwen2.5-0.5b-prefill         # prefill at 1K-16K tokens
    python -m attention_core.bench --preset qwen2.5-0.5b-decode          # one token against a 4K / 16K cache
    python -m attention_core.bench --preset qwen2.5-0.5b-prefill --sizes 1024,2048 --rounds 3 --depth 1
    python -m attention_core.bench --preset zimage-turbo --quick        # tiny sizes: does it run here?

Every case runs in a fresh process (measure.py: time is the median of --repeats runs after the first, memory the
first run's peak over what the model and inputs already held); --rounds R runs every method once per round,
alternating the order, and reports the median over rounds. Tables print in Markdown, with the load they ran at;
--json and --plot are not written when other processes kept the machine busy unless --force-busy (as in
attention_core.bench). The models and what each method is: zimage.py, qwen.py.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

PRESETS = {
    "zimage-turbo": "Z-Image Turbo DiT at 512-2048 px: attention (30 x 128 heads, image + text tokens) and a DiT step",
    "qwen2.5-0.5b-prefill": "Qwen 2.5 0.5B prefill at 1K-16K tokens (transformers' Qwen2, real widths, fewer layers)",
    "qwen2.5-0.5b-decode": "Qwen 2.5 0.5B decode step: one query token against a 4K and a 16K cache",
}


def wants(argv) -> bool:
    """True when argv asks attention_core.bench for one of these presets (--preset NAME or --preset=NAME)."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg == "--preset" and i + 1 < len(argv):
            return argv[i + 1] in PRESETS
        if arg.startswith("--preset="):
            return arg.split("=", 1)[1] in PRESETS
    return False


def help_lines() -> str:
    return "; ".join(f"{name} ({text})" for name, text in PRESETS.items())


def _parser():
    from .. import cli_args
    from ...device import machine_load
    ap = cli_args.Parser(prog="python -m attention_core.bench", description=__doc__.split("\n\n")[0],
                         epilog="model presets: " + help_lines())
    ap.add_argument("--preset", required=True, choices=list(PRESETS))
    ap.add_argument("--sizes", type=cli_args.int_list(1), default=None,
                    help="image sides in pixels (zimage-turbo: 512,1024,1536,2048) or tokens (qwen prefill: "
                         "1024,...,16384; decode: cached tokens 4096,16384)")
    ap.add_argument("--dit-sizes", type=cli_args.int_list(1), default=None,
                    help="zimage-turbo: image sides of the DiT step (default 512,1024; on a GPU give all four)")
    ap.add_argument("--methods", default=None, help="comma separated (default all of the preset's)")
    ap.add_argument("--dit-methods", default=None, help="zimage-turbo DiT step: comfy,math,engine (default all)")
    ap.add_argument("--depth", type=cli_args.int_range(0, 100), default=None,
                    help="layers (qwen: of 24, default 2) or main DiT blocks (zimage: of 30, default 1)")
    ap.add_argument("--refiners", type=cli_args.int_range(0, 2), default=0,
                    help="zimage-turbo: refiner blocks of each kind in the DiT step (the real model has 2)")
    ap.add_argument("--text-tokens", type=cli_args.int_range(1), default=128,
                    help="zimage-turbo: prompt tokens (padded to 32 as the model does; default 128)")
    ap.add_argument("--no-dit", action="store_true", help="zimage-turbo: the attention table only")
    ap.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                    help="default float32 on the CPU, float16 on a GPU")
    ap.add_argument("--device", type=cli_args.device, default=None, help="cpu, cuda, cuda:1 (default: the GPU if any)")
    ap.add_argument("--repeats", type=cli_args.int_range(1, 100), default=2,
                    help="runs per case: the first gives the memory, the median of the rest the time (default 2)")
    ap.add_argument("--rounds", type=cli_args.int_range(1, 100), default=1,
                    help="every method once per round, the order alternating; median over rounds")
    ap.add_argument("--memory-budget-gb", type=float, default=None,
                    help="math SDPA cases whose scores would need more are not run (said in the table); default: "
                         "70%% of the memory available now")
    ap.add_argument("--threads", type=cli_args.int_range(0, 1024), default=0, help="torch threads (0: default)")
    ap.add_argument("--timeout", type=cli_args.int_range(1, 7 * 86400), default=3600, help="seconds per case")
    ap.add_argument("--comfyui", type=cli_args.comfyui_folder, default=None,
                    help="ComfyUI folder (zimage-turbo: its sub-quadratic attention and its NextDiT; default "
                         "$COMFYUI_LATEST_PATH, $COMFYUI_PATH, else the 0.33.0 ./dev sets up)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes, one layer / block, one run per case (a smoke test; the DiT 384 wide, the "
                         "Qwen vocabulary 1024)")
    ap.add_argument("--json", type=cli_args.at_caller(cli_args.output_file), help="write the rows and info here")
    ap.add_argument("--plot", type=cli_args.at_caller(cli_args.output_file),
                    help="write a PNG chart here (zimage-turbo: the DiT step's beside it, -dit before the suffix)")
    ap.add_argument(machine_load.FORCE_FLAG, action="store_true",
                    help="write --json / --plot even when other processes kept the machine busy")
    return ap


def _budget(a, device: str) -> float:
    if a.memory_budget_gb is not None:
        return a.memory_budget_gb * (1 << 30)
    import torch
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return 0.7 * free
    import psutil
    return 0.7 * psutil.virtual_memory().available


def _methods(ap, flag, given, allowed):
    if not given:
        return list(allowed)
    got = [m.strip() for m in given.split(",") if m.strip()]
    bad = [m for m in got if m not in allowed]
    if bad or not got:
        from .. import cli_args
        cli_args.fail(ap, flag, f"unknown method(s) {', '.join(bad) or '(none)'}; choose from {', '.join(allowed)}")
    return got


def main(argv=None) -> int:
    from .. import cli_args
    from ...device import machine_load
    from . import measure, qwen, zimage
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = _parser()
    a = ap.parse_args(argv)
    for name in ("sizes", "dit_sizes"):  # cli_args.int_list checks the text and keeps it
        if isinstance(getattr(a, name), str):
            setattr(a, name, [int(x) for x in getattr(a, name).split(",") if x.strip()])
    import torch
    a.device = a.device or cli_args.default_device()
    a.dtype = a.dtype or ("float32" if a.device == "cpu" else "float16")
    elem = getattr(torch, a.dtype).itemsize
    budget = _budget(a, a.device)
    if a.quick:
        a.repeats, a.rounds = 1, 1
    tables = []  # (key, title, methods, labels, module, cases, base, ours)
    if a.preset == zimage.NAME:
        a.comfyui = a.comfyui or zimage.default_comfyui()
        a.sizes = a.sizes or (zimage.QUICK_SIZES if a.quick else zimage.SIZES)
        a.dit_sizes = a.dit_sizes or (zimage.QUICK_SIZES[:1] if a.quick else zimage.DIT_SIZES)
        a.depth = 1 if a.depth is None or a.quick else a.depth
        a.methods = _methods(ap, "--methods", a.methods, zimage.ATTN_METHODS)
        a.dit_methods = _methods(ap, "--dit-methods", a.dit_methods, zimage.DIT_METHODS)
        t_attn, t_dit = zimage.describe(a)
        tables.append(("attention", t_attn, a.methods, zimage.ATTN_LABELS, "attention_core.bench",
                       zimage.attention_cases(a, elem, budget), "math", "auto"))
        if not a.no_dit:
            tables.append(("dit", t_dit, a.dit_methods, zimage.DIT_LABELS, "attention_core.cli.bench_models.zimage",
                           zimage.dit_cases(a, elem, budget), "comfy", "engine"))
    else:
        kind = "prefill" if a.preset == qwen.NAMES["prefill"] else "decode"
        a.sizes = a.sizes or (qwen.QUICK_SIZES if a.quick else qwen.SIZES)[kind]
        a.depth = 1 if a.quick else (a.depth or 2)
        a.vocab = 1024 if a.quick else qwen.VOCAB
        a.methods = _methods(ap, "--methods", a.methods, qwen.METHODS)
        tables.append((kind, qwen.describe(kind, a), a.methods, qwen.LABELS, "attention_core.cli.bench_models.qwen",
                       qwen.cases(kind, a, elem, budget), "math", "engine"))
    info = {"preset": a.preset, "device": a.device, "dtype": a.dtype, "torch": torch.__version__,
            "command": "python -m attention_core.bench " + " ".join(argv), "threads": a.threads or
            torch.get_num_threads(), "rounds": a.rounds, "repeats": a.repeats, "budget_gb": budget / (1 << 30),
            "load_start": measure.load_average()}
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if a.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(a.device))
    print(f"# {a.preset} on {a.device} ({info.get('gpu', 'CPU')}), {a.dtype}, torch {torch.__version__}, "
          f"{a.rounds} round(s) x {a.repeats} run(s), math budget {budget / (1 << 30):,.1f} GB, "
          f"load {info['load_start']}", flush=True)
    monitor = machine_load.Monitor(force=a.force_busy)
    results = {}
    with monitor:
        for key, title, methods, labels, module, cases, base, ours in tables:
            print(f"\n{title}", flush=True)
            results[key] = measure.rounds(cases, methods, a.rounds,
                                          lambda c, mod=module: measure.run_in_process(mod, c, a.timeout), monitor,
                                          say=lambda s: print(s, flush=True))
    info["load_end"] = measure.load_average()
    info["load"] = load = monitor.summary()
    for key, title, methods, labels, module, cases, base, ours in tables:
        print(measure.table(results[key], methods, labels, title, base=base, ours=ours))
        wrong = [r for r in results[key] if r.get("routed") is not None and r["routed"] != r.get("expected")]
        for r in wrong:
            print(f"warning: {r['size']} {r['method']}: the engine ran {r['routed']} of the {r['expected']} attention "
                  "calls it should have (the others went elsewhere)")
    loaded = (f"{machine_load.describe(load)}; load average {info['load_start']} at the start, {info['load_end']} at "
              "the end")
    print(f"\nmeasured at: {loaded}")
    if a.json or a.plot:
        refused = machine_load.refusal(load, " / ".join(f for f, v in (("--json", a.json), ("--plot", a.plot)) if v))
        if refused:
            print(f"error: {refused}", file=sys.stderr)
            return 2
    if load["busy"]:
        print(f"warning: machine busy ({machine_load.describe(load)}): these figures are unreliable"
              + (f"; saved anyway ({machine_load.FORCE_FLAG})" if load["forced"] else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"info": info, "results": results}, f, indent=1)
        print(f"wrote {a.json}")
    if a.plot:
        for i, (key, title, methods, labels, *_rest) in enumerate(tables):
            root, ext = os.path.splitext(a.plot)
            path = a.plot if i == 0 else f"{root}-{key}{ext or '.png'}"
            if measure.plot(results[key], methods, labels, path, title, loaded):
                print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

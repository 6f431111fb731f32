"""Side-by-side attention benchmark: time, peak extra memory and max error vs float64, over sequence lengths.

    python -m attention_core.bench                          # the default sweep on the best device here
    python -m attention_core.bench --n 4096 --heads 16 --mode fwd --json out.json --plot out.png
    python -m attention_core.bench --comfyui /path/to/ComfyUI   # ComfyUI's sub-quadratic and split attention from there
    python -m attention_core.bench --preset wan22-5b-480p --mode fwd      # a real video model's attention shape
    python -m attention_core.bench --preset wan22-5b-720p --quick         # big: one repeat, fewer methods, no fp64 ref

Presets (video self-attention, batch 1; tokens from attention_core.plan's latent rules):
    wan22-5b-480p   N=4,290   24 x 128  Wan 2.2 TI2V 5B, 832x480, 41 frames
    wan22-5b-4096   N=4,096   24 x 128  the same heads at N=4096 (the chunked-vs-math target)
    wan22-5b-720p   N=28,520  24 x 128  Wan 2.2 TI2V 5B, 1280x720, 121 frames
    wan-14b-480p    N=32,760  40 x 128  Wan 2.1/2.2 14B, 832x480, 81 frames
    ltx23-22b-720p  N=14,960  32 x 128  LTX-2.3 22B video stream, 1280x704, 129 frames
    reference       N=1024,2048,4096  16 x 64  the reference project's benchmark shape
Model presets (whole models and their steps, their own options: --preset NAME --help; attention_core.cli.bench_models):
    zimage-turbo           Z-Image Turbo: attention at 512-2048 px (+ ComfyUI's sub-quadratic), a DiT step in ComfyUI
    qwen2.5-0.5b-prefill   Qwen 2.5 0.5B prefill at 1K-16K tokens, transformers' Qwen2 through the global patch
    qwen2.5-0.5b-decode    Qwen 2.5 0.5B decode step: one token against a 4K and a 16K cache

Methods: torch math SDPA, torch's default SDPA (fused where it exists), each tier of this engine (`chunked-prev`,
`auto-prev`: the same with the default CPU tiles before issue 18.5, 2^21 scores a forward tile; `chunked-queries`,
`chunked-keys`: the chunked tier with its score layout forced, issue 18.4), and when
importable the peers noflash-attention 1.0.1 (its tier functions, called directly) and ComfyUI's attention.
Memory is measured honestly: on the CPU every case runs in a fresh process whose peak-RSS mark (VmHWM, the
per-process ru_maxrss) is reset once its inputs exist, and reports the peak's growth over that RSS; on a GPU,
torch.cuda.max_memory_allocated over the allocated baseline.
Cases run with OMP_WAIT_POLICY=PASSIVE unless set or --omp-wait-policy says otherwise (the same for every method;
see cli/bench_run.py).
Errors are against torch's math SDPA in float64 (or this engine's chunked tier in float64 when the float64
score matrix would not fit, marked "ref=tiled64").
Every case's line names the load it ran at: other processes' runnable threads while it ran ("others", sampled by
attention_core.device.machine_load) and the 1-minute load average. --json and --plot are not written when other
processes kept the machine busy (machine_load's threshold: a quarter of the cores) unless --force-busy; the JSON's
info holds the load either way ("load": mean, max, cores, threshold, busy, forced).
"""
from __future__ import annotations

import argparse
import os
import sys

from ..device import machine_load
from . import bench_presets, bench_report, bench_run, cli_args
from .bench_methods import METHODS, QUICK_METHODS
from .bench_run import OMP_WAIT_POLICIES
from .plan import PRESETS


def default_comfyui():
    """ComfyUI for the comfy-* methods: $COMFYUI_LATEST_PATH, $COMFYUI_PATH, else the stock 0.33.0 ./dev set up."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for path in (os.environ.get("COMFYUI_LATEST_PATH"), os.environ.get("COMFYUI_PATH"),
                 os.path.join(root, ".cache", "comfyui-0.33.0")):
        if path and os.path.isfile(os.path.join(path, "comfy", "model_management.py")):
            return path
    return None


def parser(model_presets):
    """The command line (`model_presets`: the model presets' help lines, bench_models.help_lines())."""
    ap = cli_args.Parser(prog="python -m attention_core.bench", description=__doc__.split("\n\n")[0],
                         epilog="presets: " + ", ".join(PRESETS) + "; model presets (--preset NAME --help for "
                         "their options): " + model_presets)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--preset", type=cli_args.choice_list(PRESETS, "presets"),
                    help="comma-separated presets (real model shapes; see the module docstring)")
    ap.add_argument("--n", type=cli_args.int_list(1), default="1024,2048,4096",
                    help="forward sequence lengths (comma separated)")
    ap.add_argument("--heads", type=cli_args.int_range(1), default=None,
                    help="heads (default 16); with --preset it replaces the preset's heads (a quicker run of the "
                         "same per-head shape; the table shows the heads used)")
    ap.add_argument("--dim", type=cli_args.int_range(1), default=64)
    ap.add_argument("--batch", type=cli_args.int_range(1), default=1)
    ap.add_argument("--bwd-n", type=cli_args.int_list(1), default="1024,2048",
                    help="forward+backward sequence lengths")
    ap.add_argument("--bwd-heads", type=cli_args.int_range(1), default=8)
    ap.add_argument("--dtype", type=cli_args.dtype_list, default=None,
                    help="comma separated; float32 on the CPU, float16 on GPUs by default")
    ap.add_argument("--device", type=cli_args.device, default=None,
                    help="cpu, cuda, cuda:1, ... (default: the accelerator if any)")
    ap.add_argument("--mode", choices=["fwd", "fwdbwd", "both"], default=None,
                    help="default: both, or fwd with --preset")
    ap.add_argument("--methods", type=cli_args.choice_list(METHODS, "methods"), default=None,
                    help=f"comma separated, default all: {','.join(METHODS)}")
    ap.add_argument("--repeats", type=cli_args.int_range(1, 1000), default=3,
                    help="timed runs per case after the first (median)")
    ap.add_argument("--rounds", type=cli_args.int_range(1, 100), default=1,
                    help="run every method once per round, rounds alternating the method order, and report the "
                         "median over rounds (for busy machines: load drift hits every method alike)")
    ap.add_argument("--quick", action="store_true",
                    help=f"one timed run, methods {','.join(QUICK_METHODS)} unless --methods, no float64 "
                         "reference above N=8192 (error column '-')")
    ap.add_argument("--no-ref", action="store_true", help="skip the float64 reference (no error column)")
    ap.add_argument("--threads", type=cli_args.int_range(0, 1024), default=0,
                    help="torch threads per case (0: torch's default)")
    ap.add_argument("--omp-wait-policy", choices=OMP_WAIT_POLICIES, default=None,
                    help="OpenMP's wait policy in every case's process: passive (the default unless "
                         "$OMP_WAIT_POLICY is set: steadiest on small shared VMs), active, or default (the variable "
                         "removed: OpenMP's own spin-then-sleep, what ComfyUI runs with unless you set it)")
    ap.add_argument("--timeout", type=cli_args.int_range(1, 7 * 86400), default=900, help="seconds per case")
    ap.add_argument("--comfyui", type=cli_args.comfyui_folder, default=default_comfyui(),
                    help="ComfyUI folder for its attention (default: "
                    "$COMFYUI_LATEST_PATH, $COMFYUI_PATH, else the stock 0.33.0 of ./dev)")
    ap.add_argument("--json", type=cli_args.at_caller(cli_args.output_file), help="write all results here")
    ap.add_argument("--plot", type=cli_args.at_caller(cli_args.output_file),
                    help="write a PNG of time and memory per method here")
    ap.add_argument("--from-json", type=cli_args.at_caller(cli_args.existing_file),
                    help="print the tables (and --plot) of a saved --json run, running nothing")
    ap.add_argument(machine_load.FORCE_FLAG, action="store_true",
                    help="write --json / --plot even when other processes kept the machine busy while it measured "
                         "(their runnable threads above a quarter of the cores on average); the files record the load")
    return ap


def main(argv=None):
    """Run the benchmark the command line asks for (a model preset hands over to bench_models); the exit status."""
    from . import bench_models
    if bench_models.wants(sys.argv[1:] if argv is None else argv):  # a model preset: its own options and tables
        return bench_models.main(argv)
    ap = parser(bench_models.help_lines())
    a = ap.parse_args(argv)
    if a.case:  # internal: one case in this fresh process (bench_run._run_in_subprocess)
        return bench_run.run_child(ap, a.case)
    if a.from_json:
        return bench_report.replay(ap, a.from_json, a.plot)
    a.mode = a.mode or ("fwd" if a.preset else "both")
    device = a.device or cli_args.default_device()
    a.dtype = a.dtype or ("float32" if device == "cpu" else "float16")
    methods = [m.strip() for m in (a.methods or ",".join(QUICK_METHODS if a.quick else METHODS)).split(",")
               if m.strip()]
    bench_presets.check_inputs_fit(ap, a, device)
    rows, info = bench_run.sweep(a, device, methods, argv)
    return bench_report.finish(rows, info, a.json, a.plot)


if __name__ == "__main__":
    sys.exit(main())

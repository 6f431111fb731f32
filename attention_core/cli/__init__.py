"""The engine's commands, one module each, run as `python -m attention_core.<command>` (the one-line modules of that
name at the package's top level run them here and, imported, are these modules):
    bench        side-by-side attention benchmark (main and options; bench_presets: the cases a run measures,
                 bench_methods: what each method calls, bench_run: one case in a fresh process and the sweep,
                 bench_report: tables, chart, saved runs; bench_models/: whole-model presets)
    plan         will it fit: tokens and per-call memory of a video model's attention and feed-forward
    tune         per-device tile profiles          calibrate   measured throughput for the time estimate
    report       one Markdown file about this GPU   selfcheck   every tier against float64 math SDPA here
and what they share: cli_args (argument checks: one `error:` line naming the flag) and estimate (time per step
from a calibration; pure arithmetic). Nothing here is imported by the engine itself (attention_core's public API,
kernel/, device/): the commands sit on top of it.
"""

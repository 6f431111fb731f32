"""The demo: the bundled Wan 2.2 workflow in a real ComfyUI at the real attention width, with what gfx906 users get
today (ComfyUI's sub-quadratic attention, its default there; optionally math SDPA) against the pack's recommended
setting (Patch Attention) and Patch Attention + FFN Chunking.

    ./dev demo                        # quick: 832x480, 21 frames (2,340 tokens), 1 block, 3 steps, 2 rounds
    ./dev demo --full                 # the 480p workflow's 4,290 tokens, 2 blocks, 4 steps, 3 rounds, + math SDPA
    ./dev demo --models ~/ComfyUI/models --steps 20   # your real Wan 2.2 5B weights, all 30 blocks

The model is the real Wan 2.2 TI2V 5B architecture (hidden 3072 = 24 heads x 128, FFN 14336, patch 1x2x2, the
48-channel 16x16x4 VAE latent) with random weights and fewer blocks, so a CPU finishes; the text encoder and the
VAE are narrow (their width does not touch attention). A ComfyUI server started with --use-quad-cross-attention
runs sub-quadratic and the pack's configurations; with math SDPA, a second one runs --use-pytorch-cross-attention
with only torch's math SDPA backend allowed (what that flag gets on gfx906, which has no fused SDPA). The
configurations run in rounds, interleaved (each round runs every configuration once, in alternating order). A
demo-only custom node stamps the time of every sampling step: the time per step is the median of all steps but
each run's first (which carries one-off work, shown apart), memory the median of the runs' peaks; the first
round also decodes, and its frames are compared with sub-quadratic's of the same seed. When other processes load
the machine (before it starts, or while it measures: attention_core.device.machine_load), the summary says so instead of
a speed ratio.

Nothing is written outside the clone: the servers' files go to --workdir (.cache/demo), matplotlib's cache and
config to .cache/matplotlib (MPLCONFIGDIR, unless set), the chart and results to --out-dir. Relative paths given to
--out-dir, --chart, --json, --workdir and --models are relative to the folder the demo was called from (./dev
passes it in $TILED_ATTENTION_CALLER_CWD).
"""
import argparse
import json
import os
import re
import shutil
import statistics
import sys
import time

from ..comfyui_setup.comfy_server import ComfyServer
from ..comfyui_setup.comfyui import LATEST, ROOT, comfy_path, import_comfy
from . import demo_chart
from .demo_summary import busy_reason, headline, step_times, summarize, table
from ..comfyui_setup.prompt_tools import output_files, resized, without_patch, workflow_api

WORKFLOW = os.path.join(ROOT, "workflows", "Wan 2.2 5B Text to Video 480p.json")
FILES = {"diffusion_models": "wan2.2_ti2v_5B_fp16.safetensors",
         "text_encoders": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "vae": "wan2.2_vae.safetensors"}
PRESETS = {"480p": (832, 480, 41), "720p": (1280, 720, 121)}
# the real Wan 2.2 TI2V 5B attention and feed-forward widths
REAL_WIDTH = dict(heads=24, ffn_dim=14336)
TILER = "TiledAttentionPatch"
# a custom node file for the math server: ComfyUI's PyTorch attention through torch's math backend only
MATH_ONLY = '''"""demo only: ComfyUI's PyTorch attention with torch's math SDPA backend alone (as on GPUs without fused SDPA)."""
import comfy.ops
from torch.nn.attention import SDPBackend, sdpa_kernel

_sdpa = comfy.ops.scaled_dot_product_attention


def _math_only(*args, **kwargs):
    with sdpa_kernel([SDPBackend.MATH]):
        return _sdpa(*args, **kwargs)


comfy.ops.scaled_dot_product_attention = _math_only
NODE_CLASS_MAPPINGS = {}
print("[demo] torch SDPA restricted to the math backend")
'''
# a custom node file for both servers: the time the sampler starts and each of its steps ends, in the server log
STEP_CLOCK = '''"""demo only: prints '[demo-step] start T' when a sampler starts and '[demo-step] i/n T' after each step."""
import time

import latent_preview

_prepare = latent_preview.prepare_callback


def _clocked(model, steps, *args, **kwargs):
    inner = _prepare(model, steps, *args, **kwargs)
    print(f"[demo-step] start {time.time():.3f}", flush=True)

    def callback(step, x0, x, total_steps):
        print(f"[demo-step] {step + 1}/{total_steps} {time.time():.3f}", flush=True)
        return inner(step, x0, x, total_steps)
    return callback


latent_preview.prepare_callback = _clocked
NODE_CLASS_MAPPINGS = {}
'''
# the quick default and the full-size run (--full); each flag given overrides its profile's value
PROFILES = {"quick": dict(size=(832, 480, 21), blocks=1, steps=3, repeats=2, math=False, minutes="about 10"),
            "full": dict(size=(832, 480, 41), blocks=2, steps=4, repeats=3, math=True, minutes="60-90")}


def say(msg):
    print(f"[demo] {msg}", flush=True)


def has_gpu():
    import torch
    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def parse_args(argv=None):
    q, f = PROFILES["quick"], PROFILES["full"]

    def size(p):
        return "x".join(map(str, p["size"]))
    ap = argparse.ArgumentParser(
        prog="./dev demo", description=__doc__.split("\n\n")[0],
        epilog=f"Expected time on 2 CPU cores with nothing else running: {q['minutes']} min for the default run, "
               f"{f['minutes']} min for --full (set-up of the venv and ComfyUI not included). On a GPU, minutes.")
    ap.add_argument("--full", action="store_true",
                    help=f"the full-size run: {size(f)} (the 480p workflow's 4,290 tokens), {f['blocks']} blocks, "
                         f"{f['steps']} steps, {f['repeats']} rounds, with math SDPA ({f['minutes']} min on 2 cores)")
    ap.add_argument("--models", help="a ComfyUI models folder holding the Wan 2.2 5B files (default: random "
                                     "weights)")
    ap.add_argument("--workdir", default=os.path.join(ROOT, ".cache", "demo"),
                    help="where the servers keep their files (default: %(default)s)")
    ap.add_argument("--out-dir", default="demo-output",
                    help="where the chart and the results go, relative to the current folder (default: %(default)s)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="480p: 832x480x41 = 4,290 tokens; 720p: 1280x720x121 = 28,520 tokens, long on a CPU "
                         f"(default: {size(q)}; --full: {size(f)})")
    ap.add_argument("--size", default=None, help="WIDTHxHEIGHTxFRAMES instead of a preset")
    ap.add_argument("--blocks", type=int, default=None,
                    help=f"transformer blocks of the random-weight model, real: 30 (default: {q['blocks']}; "
                         f"--full: {f['blocks']})")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"sampling steps per run, >= 2: the first is shown apart (default: {q['steps']}; "
                         f"--full: {f['steps']})")
    ap.add_argument("--repeats", type=int, default=None,
                    help=f"rounds: runs of each configuration, interleaved (default: {q['repeats']}; "
                         f"--full: {f['repeats']})")
    ap.add_argument("--math", action=argparse.BooleanOptionalAction, default=None,
                    help="also run math SDPA in a second server (what --use-pytorch-cross-attention gives on gfx906; "
                         "adds a second server and about a third more time) (default: off; --full: on)")
    ap.add_argument("--mode", choices=["auto", "chunked", "inplace", "online"], default=None,
                    help="Patch Attention mode (default: auto on GPUs, chunked on the CPU, whose torch has a "
                         "fused kernel that auto would leave in place)")
    ap.add_argument("--ffn-chunks", type=int, default=4,
                    help="FFN Chunking chunks in the '+ FFN Chunking' run; 0 = from free memory, which on a machine "
                         "with RAM to spare is 1: no chunking (default: %(default)s)")
    ap.add_argument("--chart", default=None, help="PNG chart path (default: <out-dir>/demo.png)")
    ap.add_argument("--json", default=None, help="results JSON path (default: <out-dir>/demo.json)")
    ap.add_argument("--report-only", action="store_true", help="re-print the table and chart of <workdir>/runs.json")
    a = ap.parse_args(argv)
    from attention_core.cli.cli_args import caller_path  # here: --help must not import torch (attention_core does)
    for name in ("out_dir", "chart", "json", "workdir", "models"):  # as the caller meant them, not from the clone
        if getattr(a, name):
            setattr(a, name, caller_path(getattr(a, name)))
    if a.size and not re.fullmatch(r"\d+x\d+x\d+", a.size):
        ap.error(f"--size must look like 832x480x41, got {a.size!r}")
    if a.size and a.preset:
        ap.error("--size and --preset: give one of them")
    profile = PROFILES["full" if a.full else "quick"]
    for name in ("blocks", "steps", "repeats", "math"):
        if getattr(a, name) is None:
            setattr(a, name, profile[name])
    a.frame_size = (tuple(int(x) for x in a.size.split("x")) if a.size else
                    PRESETS[a.preset] if a.preset else profile["size"])
    a.preset = a.preset or next((k for k, v in PRESETS.items() if v == a.frame_size), None)
    for name in ("blocks", "repeats"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(a, name)}")
    if a.steps < 2:
        ap.error(f"--steps must be >= 2 (the first step of a run carries one-off work and is shown apart), "
                 f"got {a.steps}")
    if a.ffn_chunks < 0:
        ap.error(f"--ffn-chunks must be >= 0, got {a.ffn_chunks}")
    return a


class Peak:
    """Peak memory of one server process over one prompt: Linux VmHWM (reset through /proc/PID/clear_refs) on
    the CPU; on a GPU the most VRAM in use seen in /system_stats while the prompt ran."""

    def __init__(self, server, gpu):
        self.server, self.gpu, self.peak, self.start = server, gpu, 0, 0

    def _status(self, key):
        with open(f"/proc/{self.server.proc.pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        return 0

    def _vram(self):
        dev = self.server.get("/system_stats")["devices"][0]
        return dev["vram_total"] - dev["vram_free"]

    def reset(self):
        self.peak = 0
        if self.gpu:
            self.start = self._vram()
            return
        with open(f"/proc/{self.server.proc.pid}/clear_refs", "w") as f:
            f.write("5")
        self.start = self._status("VmRSS")

    def sample(self):
        self.peak = max(self.peak, self._vram() if self.gpu else self._status("VmHWM"))


def run(server, prompt, label, peak):
    """Queue a prompt and wait; (wall seconds, first step seconds, later steps' seconds, peak bytes, growth bytes,
    history entry, samples of other processes' runnable threads: machine_load.others_runnable, which leaves out
    this process and its children, the servers)."""
    from attention_core.device import machine_load
    peak.reset()
    start = time.time()
    log_start = len(server.log())
    pid = server.post("/prompt", {"prompt": prompt, "client_id": "demo"})["prompt_id"]
    others = []
    while True:
        hist = server.get(f"/history/{pid}")
        peak.sample()
        n = machine_load.others_runnable()
        if n is not None:
            others.append(n)
        if pid in hist and hist[pid].get("status", {}).get("completed") is not None:
            break
        time.sleep(0.5)
    entry = hist[pid]
    if entry["status"].get("status_str") != "success":
        raise SystemExit(f"[demo] {label} failed: {json.dumps(entry['status'].get('messages', []))[-2000:]}\n"
                         f"server log: {server.log_path}")
    secs = time.time() - start
    first, later = step_times(server.log()[log_start:])
    return secs, first, later, peak.peak, peak.peak - peak.start, entry, others


def start_all(servers, timeout=1200):
    """Start the servers side by side (each takes minutes on a busy CPU); raise the first failure."""
    import threading
    errors = []

    def one(s):
        try:
            s.start(timeout=timeout)
        except Exception as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
    threads = [threading.Thread(target=one, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def frames_of(paths):
    """Decoded frames (the PNGs the prompt saved) as one float array in [0, 1]."""
    import numpy as np
    from PIL import Image
    return np.stack([np.asarray(Image.open(p), dtype=np.float32) / 255.0 for p in sorted(paths)])


def write_models(models, a):
    """Real weights linked in, or the real-width random-weight Wan 2.2 5B with `a.blocks` blocks."""
    if a.models:
        say(f"using the real Wan 2.2 5B weights in {a.models}")
        for d, f in FILES.items():
            os.makedirs(os.path.join(models, d), exist_ok=True)
            dst = os.path.join(models, d, f)
            if os.path.lexists(dst):
                os.remove(dst)
            os.symlink(os.path.join(a.models, d, f), dst)
        return
    stamp = os.path.join(models, f"real-width-{a.blocks}-blocks")
    if os.path.exists(stamp):  # written by an earlier run
        return
    say(f"writing a real-width random-weight Wan 2.2 TI2V 5B ({REAL_WIDTH['heads']} heads x 128 = 3072 wide, "
        f"FFN {REAL_WIDTH['ffn_dim']}, {a.blocks} block{'s' * (a.blocks > 1)}; fp16 file) and narrow UMT5 / Wan 2.2 VAE files")
    import_comfy(LATEST)
    import torch
    from safetensors.torch import save_file

    from ..fixtures.tiny_models import wan22_5b_state_dict, write_umt5, write_wan22_vae
    shutil.rmtree(models, ignore_errors=True)
    sd = {k: v.half() for k, v in wan22_5b_state_dict(layers=a.blocks, **REAL_WIDTH).items()}
    path = os.path.join(models, "diffusion_models", FILES["diffusion_models"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(sd, path)
    del sd, torch
    write_umt5(os.path.join(models, "text_encoders", FILES["text_encoders"]))
    write_wan22_vae(os.path.join(models, "vae", FILES["vae"]))
    open(stamp, "w").close()


DECODE = ("VAEDecode", "VAEDecodeTiled")


def configure(prompt, prefix, size, frames, steps, seed, patch, ffn, mode, ffn_chunks=4, decode=True):
    """The workflow at this size, steps and seed, with or without the pack's two nodes (FFN Chunking off or on),
    decoded in small tiles so the decode's memory stays under the sampler's; decode=False leaves out the decode
    and everything after it (only the sampled latent is saved: the rounds after the first, which only time)."""
    p = resized(prompt if patch else without_patch(prompt), prefix, size=size, frames=frames, steps=steps,
                mode=mode, min_tokens=1024)
    if not decode:
        gone = {nid for nid, n in p.items() if n["class_type"] in DECODE}
        while True:
            more = {nid for nid, n in p.items() if nid not in gone and any(
                isinstance(v, list) and len(v) == 2 and str(v[0]) in gone for v in n["inputs"].values())}
            if not more:
                break
            gone |= more
        p = {nid: n for nid, n in p.items() if nid not in gone}
    for node in p.values():
        ct, inp = node["class_type"], node["inputs"]
        if ct in ("KSampler", "KSamplerAdvanced"):
            inp["seed" if "seed" in inp else "noise_seed"] = seed
        elif ct == "TiledFFNChunking":
            inp["enabled"] = bool(ffn and patch)
            inp["chunks"] = ffn_chunks
        elif ct == "VAEDecodeTiled":
            inp.update(tile_size=128, overlap=32, temporal_size=8, temporal_overlap=4)
    return p


def use_clone_for_matplotlib():
    """matplotlib's cache and config in the clone's .cache/matplotlib, not ~/.cache and ~/.config (unless
    MPLCONFIGDIR is set): main() calls it first, before matplotlib is imported, and the servers inherit it."""
    os.environ.setdefault("MPLCONFIGDIR", os.path.join(ROOT, ".cache", "matplotlib"))


def save_runs(path, meta, runs):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"meta": meta, "runs": runs}, f, indent=1)
    os.replace(tmp, path)


def frame_diffs(configs, runs):
    """label -> largest |frame difference| from the default configuration's run of the same round (None where
    nothing could be compared)."""
    base = next(label for label, role in configs if role == "default")
    cache = {}

    def frames_for(label, rep):
        if (label, rep) not in cache:
            r = next((x for x in runs if x["label"] == label and x["rep"] == rep), None)
            cache[label, rep] = frames_of(r["pngs"]) if r and r["pngs"] else None
        return cache[label, rep]
    out = {}
    for label, _ in configs:
        diffs = []
        for r in (x for x in runs if x["label"] == label):
            ref, got = frames_for(base, r["rep"]), frames_for(label, r["rep"])
            if ref is not None and got is not None and ref.shape == got.shape:
                diffs.append(float(abs(ref - got).max()))
        out[label] = max(diffs) if diffs else None
    return out


def report(meta, runs, a):
    """The table, the headline, the chart and the results JSON (also from a saved runs.json: --report-only);
    returns the per-configuration results."""
    if "configs" not in meta:
        raise SystemExit(f"[demo] {a.workdir}/runs.json is from an older demo: run the demo again")
    configs = [tuple(c) for c in meta["configs"]]
    results = summarize(configs, runs, frame_diffs(configs, runs))
    what = "VRAM in use" if meta["gpu"] else "RSS of the server"
    print("\n".join(table(results, what)))
    others = [x for r in runs for x in r.get("others", [])]
    busy = busy_reason(meta["cores"], meta.get("load_before"), others)
    model = "Wan 2.2 5B" if meta["real"] else f"Wan 2.2 5B at real width ({meta['blocks']} block{'s' * (meta['blocks'] > 1)})"
    where = "GPU" if meta["gpu"] else f"CPU, {meta['cores']} cores"
    lines = headline(results, f"{model}, {where}", meta["tokens"], busy, gpu=meta["gpu"])
    if not lines:
        print("(the sub-quadratic run or the Patch Attention run is missing: no summary)")
        return results
    os.makedirs(a.out_dir, exist_ok=True)
    chart_path = os.path.abspath(a.chart or os.path.join(a.out_dir, "demo.png"))
    json_path = os.path.abspath(a.json or os.path.join(a.out_dir, "demo.json"))
    saved = {**meta, "busy": busy, "headline": lines, "results": results}
    saved["chart"] = demo_chart.words(saved)  # what the chart says, and what it leaves to words
    demo_chart.draw_report(saved, chart_path)  # from what demo.json holds, and nothing else
    with open(json_path, "w") as f:
        json.dump(saved, f, indent=1)
    print(f"\n{meta['repeats']} interleaved rounds, {meta['steps']} steps a run; s/step is the median of the "
          "steps after each run's first")
    if busy:
        print(f"warning: machine busy ({busy}): the times are unreliable; run the demo again when the machine "
              "is quiet")
    print("\n".join(lines))
    print("\nthe chart: " + saved["chart"]["headline"] + "\n" + "\n".join("  " + n for n in saved["chart"]["notes"]))
    print(f"chart: {chart_path}\nresults: {json_path}")
    return results


def main(argv=None):
    a = parse_args(argv)
    use_clone_for_matplotlib()
    if a.report_only:
        with open(os.path.join(a.workdir, "runs.json")) as f:
            saved = json.load(f)
        report(saved["meta"], saved["runs"], a)
        return 0
    from attention_core.device import machine_load
    wall_start = time.time()
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    cores = os.cpu_count() or 1
    if comfy_path(LATEST) is None:
        raise SystemExit("[demo] no ComfyUI: run it as ./dev demo (it fetches the pinned stock ComfyUI) or set "
                         "COMFYUI_LATEST_PATH")
    if a.models and not all(os.path.exists(os.path.join(a.models, d, f)) for d, f in FILES.items()):
        raise SystemExit(f"[demo] {a.models} lacks some of: " + ", ".join(f"{d}/{f}" for d, f in FILES.items()))
    width, height, frames = a.frame_size
    from attention_core.cli.plan import MODELS, tokens
    n_tokens = tokens(MODELS["wan22-5b"], width, height, frames)
    gpu = has_gpu()
    mode = a.mode or ("auto" if gpu else "chunked")
    if load_before is not None and load_before > cores:
        say(f"warning: the machine is busy (load {load_before:.1f} on {cores} cores): times will be unreliable")
    os.makedirs(a.workdir, exist_ok=True)
    models = os.path.join(a.workdir, "models")
    write_models(models, a)
    names = ("subquad", "math") if a.math else ("subquad",)
    bases = {}
    for name in names:
        base = os.path.join(a.workdir, name)
        shutil.rmtree(os.path.join(base, "output"), ignore_errors=True)
        os.makedirs(os.path.join(base, "custom_nodes"), exist_ok=True)
        if not os.path.lexists(os.path.join(base, "models")):
            os.symlink(models, os.path.join(base, "models"))
        with open(os.path.join(base, "custom_nodes", "demo_step_clock.py"), "w") as f:
            f.write(STEP_CLOCK)
        bases[name] = base
    if a.math:
        with open(os.path.join(bases["math"], "custom_nodes", "demo_math_sdpa_only.py"), "w") as f:
            f.write(MATH_ONLY)
    stale = os.path.join(bases["subquad"], "custom_nodes", "demo_math_sdpa_only.py")
    if os.path.exists(stale):
        os.remove(stale)
    say(f"{'real weights' if a.models else f'real-width random weights, {a.blocks} block' + 's' * (a.blocks > 1)}; "
        f"{width}x{height}, {frames} frames = {n_tokens:,} video tokens; {a.steps} steps a run; "
        f"{a.repeats} round(s); Patch Attention mode {mode}; on the {'GPU' if gpu else 'CPU'}")
    servers = {"subquad": ComfyServer(bases["subquad"], args=["--use-quad-cross-attention"], cpu=not gpu)}
    if a.math:
        servers["math"] = ComfyServer(bases["math"], args=["--use-pytorch-cross-attention"], cpu=not gpu)
    ffn_label = "Patch Attention + FFN Chunking" + (f" ({a.ffn_chunks} chunks)" if a.ffn_chunks else "")
    # (label, role, server, patched, FFN Chunking on)
    configs = [("ComfyUI sub-quadratic", "default", "subquad", False, False)]
    if a.math:
        configs.append(("math SDPA", "math", "math", False, False))
    configs += [(f"Patch Attention ({mode})", "recommended", "subquad", True, False),
                (ffn_label, "ffn", "subquad", True, True)]
    runs_path = os.path.join(a.workdir, "runs.json")
    meta = dict(tokens=n_tokens, size=[width, height, frames], preset=a.preset, blocks=a.blocks, steps=a.steps,
                repeats=a.repeats, mode=mode, gpu=gpu, configs=[c[:2] for c in configs], real=bool(a.models),
                cores=cores, load_before=load_before)
    runs = []
    try:
        say(f"starting {len(servers)} ComfyUI server(s) from {comfy_path(LATEST)} (logs: {a.workdir}/*/server.log)")
        start_all(servers.values())
        with open(WORKFLOW) as f:
            prompt = workflow_api().workflow_to_prompt(json.load(f), servers["subquad"].get("/object_info"))
        peaks = {name: Peak(s, gpu) for name, s in servers.items()}
        say("warming up (loading the models once: no timed run pays for it)")
        for name, s in servers.items():
            warm = configure(prompt, "demo/warmup", (width, height), 1, 1, 0, False, False, mode)
            run(s, warm, "warm-up", peaks[name])
        for rep in range(a.repeats):
            order = configs if rep % 2 == 0 else configs[::-1]
            seed = 1000 + rep
            for cfg in order:
                label, role, srv, patch, ffn = cfg
                # frames are decoded and compared in the first round; later rounds only sample (and time)
                p = configure(prompt, f"demo/r{rep}-{configs.index(cfg)}", (width, height), frames, a.steps, seed,
                              patch, ffn, mode, a.ffn_chunks, decode=rep == 0)
                say(f"round {rep + 1}/{a.repeats}: {label}")
                secs, first, later, peak, growth, entry, others = run(servers[srv], p, label, peaks[srv])
                pngs = [x for x in output_files(servers[srv].base, entry, (".png",))]
                runs.append(dict(label=label, rep=rep, secs=secs, first_step=first, later_steps=later, peak=peak,
                                 growth=growth, others=others, pngs=sorted(pngs)))
                save_runs(runs_path, meta, runs)
                steps = ", ".join(f"{x:.1f}" for x in later)
                say(f"  {secs:.0f} s; steps: first {first if first is not None else float('nan'):.1f} s, then "
                    f"{steps or '-'} s; peak {peak / 2**30:.2f} GB ({growth / 2**30:+.2f} GB)"
                    + (f"; other processes' runnable threads {statistics.fmean(others):.1f}" if others else "")
                    + (f", above {machine_load.threshold(cores):g}: the machine is busy" if others and
                       statistics.fmean(others) > machine_load.threshold(cores) else ""))
        attn_lines = {name: next((re.sub(r"\x1b\[[0-9;]*m", "", ln).strip() for ln in s.log().splitlines()
                                  if "Using " in ln and "attention" in ln), "") for name, s in servers.items()}
        patched_ran = "tiled attention" in servers["subquad"].log().lower()
    finally:
        for s in servers.values():
            s.stop()
    print()
    for name, line in attn_lines.items():
        if line:
            print(f"ComfyUI ({name} server): {line}")
    if not patched_ran:
        print("warning: no '[tiled-attention]' line in the server log: Patch Attention may not have run")
    report(meta, runs, a)
    say(f"done in {(time.time() - wall_start) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())

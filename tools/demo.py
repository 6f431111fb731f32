"""The demo: the bundled Wan 2.2 workflow in a real ComfyUI at the real attention width and token count, with what
gfx906 users get today (ComfyUI's sub-quadratic attention, math SDPA) against Patch Attention and FFN Chunking.

    ./dev demo                        # real-width Wan 2.2 TI2V 5B, random weights, 2 blocks, 4,290 tokens (480p)
    ./dev demo --preset 720p          # 28,520 tokens (the 720p workflow's 1280x720, 121 frames): long on a CPU
    ./dev demo --models ~/ComfyUI/models --steps 20   # your real Wan 2.2 5B weights, all 30 blocks

The model is the real Wan 2.2 TI2V 5B architecture (hidden 3072 = 24 heads x 128, FFN 14336, patch 1x2x2, the
48-channel 16x16x4 VAE latent) with random weights and fewer blocks, so a CPU finishes; the text encoder and the
VAE are narrow (their width does not touch attention). Two ComfyUI servers run side by side: one started with
--use-quad-cross-attention (ComfyUI's sub-quadratic attention, its default where PyTorch attention is not enabled,
gfx906 included), one with --use-pytorch-cross-attention and only torch's math SDPA backend allowed (what that
flag gets on gfx906, which has no fused SDPA). Each configuration runs `--repeats` times, in alternating order;
the table shows medians of the sampling process's peak memory, the time per sampling step, and the largest
difference of the decoded frames from the unpatched sub-quadratic run of the same seed.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import sys
import textwrap
import time

from .comfy_server import ComfyServer
from .comfyui import LATEST, ROOT, comfy_path, import_comfy
from .prompt_tools import output_files, resized, without_patch, workflow_api

WORKFLOW = os.path.join(ROOT, "workflows", "wan22_5b_t2v_480p.json")
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


def say(msg):
    print(f"[demo] {msg}", flush=True)


def has_gpu():
    import torch
    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="./dev demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", help="a ComfyUI models folder holding the Wan 2.2 5B files (else random weights)")
    ap.add_argument("--workdir", default=os.path.join(ROOT, ".cache", "demo"), help="where the servers keep files")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="480p",
                    help="480p: 832x480x41 = 4,290 tokens; 720p: 1280x720x121 = 28,520 tokens")
    ap.add_argument("--size", default=None, help="WIDTHxHEIGHTxFRAMES instead of the preset (a quick look)")
    ap.add_argument("--blocks", type=int, default=2, help="transformer blocks of the random-weight model (real: 30)")
    ap.add_argument("--steps", type=int, default=1, help="sampling steps per run")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each configuration (median)")
    ap.add_argument("--mode", choices=["auto", "chunked", "inplace", "online"], default=None,
                    help="Patch Attention mode (default: auto on GPUs, chunked on the CPU, whose torch has a "
                         "fused kernel that auto would leave in place)")
    ap.add_argument("--ffn-chunks", type=int, default=4,
                    help="FFN Chunking chunks in the '+ FFN Chunking' run (0 = from free memory, which on a machine "
                         "with RAM to spare is 1: no chunking)")
    ap.add_argument("--chart", default=None, help="PNG chart path (default: <workdir>/demo.png)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--report-only", action="store_true", help="re-print the table and chart of <workdir>/runs.json")
    a = ap.parse_args(argv)
    if a.size and not re.fullmatch(r"\d+x\d+x\d+", a.size):
        ap.error(f"--size must look like 832x480x41, got {a.size!r}")
    for name in ("blocks", "steps", "repeats"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be >= 1")
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


STEP_RATE = re.compile(r"(\d+)/(\d+) \[[^\]]*?([\d.]+)(s/it|it/s)\]")


def step_seconds(log_text):
    """Seconds per step of the last finished sampler progress bar in a ComfyUI log chunk (tqdm's rate)."""
    done = [m for m in STEP_RATE.finditer(log_text.replace("\r", "\n")) if m.group(1) == m.group(2)]
    if not done:
        return None
    rate, unit = float(done[-1].group(3)), done[-1].group(4)
    return rate if unit == "s/it" else (1.0 / rate if rate else None)


def run(server, prompt, label, peak):
    """Queue a prompt and wait; (wall seconds, seconds per step, peak bytes, growth bytes, history entry)."""
    peak.reset()
    start = time.time()
    log_start = len(server.log())
    pid = server.post("/prompt", {"prompt": prompt, "client_id": "demo"})["prompt_id"]
    while True:
        hist = server.get(f"/history/{pid}")
        peak.sample()
        if pid in hist and hist[pid].get("status", {}).get("completed") is not None:
            break
        time.sleep(0.5)
    entry = hist[pid]
    if entry["status"].get("status_str") != "success":
        raise SystemExit(f"[demo] {label} failed: {json.dumps(entry['status'].get('messages', []))[-2000:]}\n"
                         f"server log: {server.log_path}")
    secs = time.time() - start
    return secs, step_seconds(server.log()[log_start:]), peak.peak, peak.peak - peak.start, entry


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
    if os.path.exists(stamp):
        return umt5_detectable(os.path.join(models, "text_encoders", FILES["text_encoders"]))
    say(f"writing a real-width random-weight Wan 2.2 TI2V 5B ({REAL_WIDTH['heads']} heads x 128 = 3072 wide, "
        f"FFN {REAL_WIDTH['ffn_dim']}, {a.blocks} blocks; fp16 file) and narrow UMT5 / Wan 2.2 VAE files")
    import_comfy(LATEST)
    import torch
    from safetensors.torch import save_file

    from .tiny_models import wan22_5b_state_dict, write_umt5, write_wan22_vae
    shutil.rmtree(models, ignore_errors=True)
    sd = {k: v.half() for k, v in wan22_5b_state_dict(layers=a.blocks, **REAL_WIDTH).items()}
    path = os.path.join(models, "diffusion_models", FILES["diffusion_models"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(sd, path)
    del sd, torch
    write_umt5(os.path.join(models, "text_encoders", FILES["text_encoders"]))
    write_wan22_vae(os.path.join(models, "vae", FILES["vae"]))
    open(stamp, "w").close()


def configure(prompt, prefix, size, frames, steps, seed, patch, ffn, mode, ffn_chunks=4):
    """The workflow at this size, steps and seed, with or without the pack's two nodes (FFN Chunking off or on),
    decoded in small tiles so the decode's memory stays under the sampler's."""
    p = resized(prompt if patch else without_patch(prompt), prefix, size=size, frames=frames, steps=steps,
                mode=mode, min_tokens=1024)
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


def chart(results, path, title, what):
    """Three panels a user reads at a glance: peak memory, seconds per step, largest frame difference."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [r["label"] for r in results]
    colors = ["#9e9e9e", "#616161", "#1e88e5", "#0d47a1"][:len(results)]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    panels = ((axes[0], [r["peak_gb"] for r in results], f"peak {what} (GB)", "{:.2f} GB"),
              (axes[1], [r["step_s"] or 0 for r in results], "time per sampling step (s)", "{:.1f} s"),
              (axes[2], [r["max_diff"] if r["max_diff"] is not None else 0 for r in results],
               "max |decoded frame difference| vs sub-quadratic\n(8-bit frames scaled to 0-1: 1/255 = 0.0039)",
               "{:.4f}"))
    for ax, vals, name, fmt in panels:
        bars = ax.barh(labels, vals, color=colors)
        ax.invert_yaxis()
        ax.set_title(name, fontsize=10)
        ax.tick_params(labelsize=9)
        for b, v in zip(bars, vals):
            ax.text(b.get_width(), b.get_y() + b.get_height() / 2, " " + fmt.format(v), va="center", fontsize=9)
        ax.set_xlim(0, (max(vals) or (1 / 255 if ax is axes[2] else 1)) * 1.35)
    for ax in axes[1:]:
        ax.set_yticklabels([])
    fig.suptitle(textwrap.fill(title, 130), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save_runs(path, meta, runs):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"meta": meta, "runs": runs}, f, indent=1)
    os.replace(tmp, path)


def report(meta, runs, a):
    """Medians per configuration, frame differences from the sub-quadratic run of the same round, the table,
    the chart and the one-line summary (also from a saved runs.json: --report-only)."""
    base_label = meta["labels"][0]
    frames = {}

    def frames_for(label, rep):
        key = (label, rep)
        if key not in frames:
            r = next((x for x in runs if x["label"] == label and x["rep"] == rep), None)
            frames[key] = frames_of(r["pngs"]) if r and r["pngs"] else None
        return frames[key]
    results = []
    for label in meta["labels"]:
        rs = [r for r in runs if r["label"] == label]
        if not rs:
            continue
        diffs = []
        for r in rs:
            ref, got = frames_for(base_label, r["rep"]), frames_for(label, r["rep"])
            if ref is not None and got is not None and ref.shape == got.shape:
                diffs.append(float(abs(ref - got).max()))
        steps = [r["step"] for r in rs if r["step"] is not None]
        results.append(dict(label=label, peak_gb=statistics.median(r["peak"] for r in rs) / 2**30,
                            growth_gb=statistics.median(r["growth"] for r in rs) / 2**30,
                            step_s=statistics.median(steps) if steps else None,
                            wall_s=statistics.median(r["secs"] for r in rs),
                            max_diff=max(diffs) if diffs else None, n=len(rs)))
    what = "VRAM in use" if meta["gpu"] else "RSS of the server"
    print(f"{'configuration':<34}{'peak ' + what:>24}{'growth':>10}{'s/step':>9}{'wall':>8}{'runs':>5}  "
          "max |frames - sub-quad|")
    for r in results:
        step = f"{r['step_s']:.1f}" if r["step_s"] is not None else "-"
        diff = f"{r['max_diff']:.2e}" if r["max_diff"] is not None else "-"
        print(f"{r['label']:<34}{r['peak_gb']:>21.2f} GB{r['growth_gb']:>7.2f} GB{step:>9}{r['wall_s']:>7.0f}s"
              f"{r['n']:>5}  {diff}")
    by = {r["label"]: r for r in results}
    sq, mth = by.get(meta["labels"][0]), by.get(meta["labels"][1])
    ours = by.get(meta["labels"][-1]) or by.get(meta["labels"][-2])
    if not (sq and ours):
        print("(the sub-quadratic run or the patched runs are missing: no summary)")
        return results
    mth = mth or dict(peak_gb=float("nan"), step_s=None)

    def sps(r):
        return f"{r['step_s']:.0f}" if r["step_s"] is not None else "?"
    model = "Wan 2.2 5B" if meta["real"] else f"Wan 2.2 5B width ({meta['blocks']} blocks)"
    summary = (f"{model}, {meta['tokens']:,} tokens: {ours['label']} peaks at "
               f"{ours['peak_gb']:.1f} GB vs {sq['peak_gb']:.1f} GB (sub-quad) and {mth['peak_gb']:.1f} GB "
               f"(math), {sps(ours)} s/step vs {sps(sq)} / {sps(mth)}; frames differ by at most "
               f"{max(r['max_diff'] or 0 for r in results):.1e}")
    chart_path = a.chart or os.path.join(a.workdir, "demo.png")
    chart(results, chart_path, summary, what)
    print(f"\nshown: {summary} (medians of {meta['repeats']} alternating runs)")
    print(f"chart: {chart_path}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**meta, "results": results}, f, indent=1)
    return results


def main(argv=None):
    a = parse_args(argv)
    if a.report_only:
        with open(os.path.join(a.workdir, "runs.json")) as f:
            saved = json.load(f)
        report(saved["meta"], saved["runs"], a)
        return 0
    if comfy_path(LATEST) is None:
        raise SystemExit("[demo] no ComfyUI: run it as ./dev demo (it fetches the pinned stock ComfyUI) or set "
                         "COMFYUI_LATEST_PATH")
    if a.models and not all(os.path.exists(os.path.join(a.models, d, f)) for d, f in FILES.items()):
        raise SystemExit(f"[demo] {a.models} lacks some of: " + ", ".join(f"{d}/{f}" for d, f in FILES.items()))
    width, height, frames = (tuple(int(x) for x in a.size.split("x")) if a.size else PRESETS[a.preset])
    from attention_core.plan import MODELS, tokens
    n_tokens = tokens(MODELS["wan22-5b"], width, height, frames)
    gpu = has_gpu()
    mode = a.mode or ("auto" if gpu else "chunked")
    os.makedirs(a.workdir, exist_ok=True)
    models = os.path.join(a.workdir, "models")
    write_models(models, a)
    bases = {}
    for name in ("subquad", "math"):
        base = os.path.join(a.workdir, name)
        shutil.rmtree(os.path.join(base, "output"), ignore_errors=True)
        os.makedirs(os.path.join(base, "custom_nodes"), exist_ok=True)
        if not os.path.lexists(os.path.join(base, "models")):
            os.symlink(models, os.path.join(base, "models"))
        bases[name] = base
    with open(os.path.join(bases["math"], "custom_nodes", "demo_math_sdpa_only.py"), "w") as f:
        f.write(MATH_ONLY)
    stale = os.path.join(bases["subquad"], "custom_nodes", "demo_math_sdpa_only.py")
    if os.path.exists(stale):
        os.remove(stale)
    say(f"{'real weights' if a.models else 'real-width random weights, ' + str(a.blocks) + ' blocks'}; "
        f"{width}x{height}, {frames} frames = {n_tokens:,} video tokens; {a.steps} step(s); "
        f"{a.repeats} repeat(s); Patch Attention mode {mode}; on the {'GPU' if gpu else 'CPU'}")
    servers = {"subquad": ComfyServer(bases["subquad"], args=["--use-quad-cross-attention"], cpu=not gpu),
               "math": ComfyServer(bases["math"], args=["--use-pytorch-cross-attention"], cpu=not gpu)}
    configs = [("ComfyUI sub-quadratic", "subquad", False, False),
               ("math SDPA", "math", False, False),
               (f"Patch Attention ({mode})", "subquad", True, False),
               (f"Patch Attention + FFN Chunking", "subquad", True, True)]
    runs_path = os.path.join(a.workdir, "runs.json")
    meta = dict(tokens=n_tokens, size=[width, height, frames], preset=a.preset, blocks=a.blocks, steps=a.steps,
                repeats=a.repeats, mode=mode, gpu=gpu, labels=[c[0] for c in configs], real=bool(a.models))
    runs = []
    try:
        say(f"starting two ComfyUI servers from {comfy_path(LATEST)} (logs: {a.workdir}/*/server.log)")
        start_all(servers.values())
        with open(WORKFLOW) as f:
            prompt = workflow_api().workflow_to_prompt(json.load(f), servers["subquad"].get("/object_info"))
        peaks = {name: Peak(s, gpu) for name, s in servers.items()}
        say("warming up both servers (loading the models once: neither timed run pays for it)")
        for name, s in servers.items():
            warm = configure(prompt, "demo/warmup", (width, height), 1, 1, 0, False, False, mode)
            run(s, warm, "warm-up", peaks[name])
        for rep in range(a.repeats):
            order = configs if rep % 2 == 0 else configs[::-1]
            seed = 1000 + rep
            for label, srv, patch, ffn in order:
                prefix = f"demo/r{rep}-{configs.index((label, srv, patch, ffn))}"
                p = configure(prompt, prefix, (width, height), frames, a.steps, seed, patch, ffn, mode,
                              a.ffn_chunks)
                say(f"round {rep + 1}/{a.repeats}: {label}")
                secs, step, peak, growth, entry = run(servers[srv], p, label, peaks[srv])
                pngs = [x for x in output_files(servers[srv].base, entry, (".png",))]
                runs.append(dict(label=label, rep=rep, secs=secs, step=step, peak=peak, growth=growth,
                                 pngs=sorted(pngs)))
                save_runs(runs_path, meta, runs)
                say(f"  {secs:.0f} s, {step if step is not None else float('nan'):.1f} s/step, peak "
                    f"{peak / 2**30:.2f} GB ({growth / 2**30:+.2f} GB)")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())

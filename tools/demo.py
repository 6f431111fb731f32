"""The demo: a real ComfyUI with this pack, the bundled Wan 2.2 workflow queued with and without Patch Attention.

    ./dev demo                       # tiny-architecture models, sized so a CPU finishes in minutes
    ./dev demo --models ~/ComfyUI/models --steps 20 --full-size   # your real Wan 2.2 5B weights

It starts ComfyUI (COMFYUI_LATEST_PATH, else the pinned stock 0.33.0 that the tests use) on the best device here,
writes tiny random-weight Wan 2.2 5B / UMT5 / Wan 2.2 VAE files when no real weights are given, runs the
workflow twice (ComfyUI's own attention, then Patch Attention) and prints time and peak memory side by side.
"""
import argparse
import json
import os
import shutil
import sys
import time

from .comfy_server import ComfyServer
from .comfyui import LATEST, ROOT, comfy_path, import_comfy
from .prompt_tools import output_files, resized, without_patch, workflow_api

WORKFLOW = os.path.join(ROOT, "workflows", "wan22_5b_t2v_480p.json")
FILES = {"diffusion_models": "wan2.2_ti2v_5B_fp16.safetensors",
         "text_encoders": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "vae": "wan2.2_vae.safetensors"}


def say(msg):
    print(f"[demo] {msg}", flush=True)


def has_gpu():
    import torch
    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


class PeakMemory:
    """Peak memory of the server process during one prompt: RSS high-water mark (Linux VmHWM, reset through
    /proc/PID/clear_refs) on the CPU; on a GPU, the most VRAM in use seen in /system_stats while it ran."""

    def __init__(self, server, gpu):
        self.server, self.gpu, self.peak, self.start = server, gpu, 0, 0

    def _status(self, key):
        with open(f"/proc/{self.server.proc.pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        return 0

    def reset(self):
        self.peak = 0
        if self.gpu:
            dev = self.server.get("/system_stats")["devices"][0]
            self.start = dev["vram_total"] - dev["vram_free"]
            return
        try:
            with open(f"/proc/{self.server.proc.pid}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        self.start = self._status("VmRSS")

    def sample(self):
        if self.gpu:
            dev = self.server.get("/system_stats")["devices"][0]
            self.peak = max(self.peak, dev["vram_total"] - dev["vram_free"])
        else:
            self.peak = max(self.peak, self._status("VmHWM"))


def run(server, prompt, label, mem):
    """Queue a prompt, show its progress from the server log, return (seconds, peak bytes, history entry)."""
    mem.reset()
    start = time.time()
    log_start = len(server.log())
    pid = server.post("/prompt", {"prompt": prompt, "client_id": "demo"})["prompt_id"]
    last = ""
    while True:
        hist = server.get(f"/history/{pid}")
        mem.sample()
        if pid in hist and hist[pid].get("status", {}).get("completed") is not None:
            break
        new = server.log()[log_start:].replace("\r", "\n")
        lines = [ln for ln in new.splitlines() if "it/s]" in ln or "s/it]" in ln]
        if lines and lines[-1] != last:
            last = lines[-1]
            print(f"\r[demo]   {label}: {last.strip()[-70:]}", end="", flush=True)
        time.sleep(0.5)
    print()
    entry = hist[pid]
    if entry["status"].get("status_str") != "success":
        raise SystemExit(f"[demo] {label} failed: {json.dumps(entry['status'].get('messages', []))[-2000:]}")
    return time.time() - start, mem.peak, mem.peak - mem.start, entry


def main(argv=None):
    ap = argparse.ArgumentParser(prog="./dev demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", help="a ComfyUI models folder holding the Wan 2.2 5B files (else tiny models)")
    ap.add_argument("--workdir", default=os.path.join(ROOT, ".cache", "demo"), help="ComfyUI base directory")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--height", type=int, default=160)
    ap.add_argument("--frames", type=int, default=17)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--full-size", action="store_true", help="keep the workflow's 832x480x41 and its steps")
    ap.add_argument("--mode", default=None, help="Patch Attention mode (default: auto on GPUs that need it, "
                                                 "else chunked, since this CPU has a fused backend)")
    a = ap.parse_args(argv)
    if comfy_path(LATEST) is None:
        raise SystemExit("[demo] no ComfyUI: run it as ./dev demo (it fetches the pinned stock ComfyUI) or set "
                         "COMFYUI_LATEST_PATH")
    os.makedirs(a.workdir, exist_ok=True)
    models = os.path.join(a.workdir, "models")
    gpu = has_gpu()
    real = a.models and all(os.path.exists(os.path.join(a.models, d, f)) for d, f in FILES.items())
    if a.models and not real:
        raise SystemExit(f"[demo] {a.models} lacks some of: " + ", ".join(f"{d}/{f}" for d, f in FILES.items()))
    if real:
        say(f"using the real Wan 2.2 5B weights in {a.models}")
        for d, f in FILES.items():
            os.makedirs(os.path.join(models, d), exist_ok=True)
            dst = os.path.join(models, d, f)
            if os.path.lexists(dst):
                os.remove(dst)
            os.symlink(os.path.join(a.models, d, f), dst)
    else:
        say("no real weights given: writing tiny random-weight models of the real architectures "
            "(Wan 2.2 TI2V-5B DiT, UMT5 text encoder, Wan 2.2 VAE); the video will be noise")
        import_comfy(LATEST)
        from .tiny_models import write_wan22_model_set
        write_wan22_model_set(models)
    shutil.rmtree(os.path.join(a.workdir, "output", "demo"), ignore_errors=True)
    say(f"starting ComfyUI from {comfy_path(LATEST)} on the {'GPU' if gpu else 'CPU'} (log: {a.workdir}/server.log)")
    with ComfyServer(a.workdir, cpu=not gpu) as server:
        say(f"ComfyUI is up at {server.url}")
        with open(WORKFLOW) as f:
            prompt = workflow_api().workflow_to_prompt(json.load(f), server.get("/object_info"))
        mode = a.mode or ("auto" if gpu else "chunked")
        sized = {} if a.full_size else dict(size=(a.width, a.height), frames=a.frames, steps=a.steps)
        # the demo's small videos have fewer tokens than the workflow's min_tokens: let every call through
        with_patch = resized(prompt, "demo/patched", mode=mode, min_tokens=None if a.full_size else 0, **sized)
        plain = resized(without_patch(prompt), "demo/comfyui", **sized)
        mem = PeakMemory(server, gpu)
        say("warming up (loading the models once, so neither run below pays for it)")
        run(server, resized(plain, "demo/warmup", steps=1, frames=1 if not a.full_size else None), "warm-up", mem)
        results = []
        for label, p in (("ComfyUI's own attention", plain), (f"Patch Attention ({mode})", with_patch)):
            say(f"queueing the Wan 2.2 workflow with {label}")
            secs, peak, growth, entry = run(server, p, label, mem)
            videos = output_files(server.base, entry, (".mp4", ".webm", ".webp"))
            results.append((label, secs, peak, growth, videos[0] if videos else "(no video)"))
        log = server.log()
    attn = next((ln for ln in log.splitlines() if ln.startswith("Using ") and "attention" in ln), "")
    print()
    what = "VRAM in use" if gpu else "RSS"
    print(f"{'run':<32}{'time':>9}{'peak ' + what:>16}{'growth':>10}  video")
    for label, secs, peak, growth, video in results:
        print(f"{label:<32}{secs:>8.1f}s{peak / 2**20:>13.0f} MB{growth / 2**20:>7.0f} MB  {video}")
    if attn:
        print(f"\nComfyUI chose: {attn.strip()}")
    if "tiled attention running" in log:
        print("Patch Attention ran (see '[tiled-attention]' in the server log).")
    return 0


if __name__ == "__main__":
    sys.exit(main())

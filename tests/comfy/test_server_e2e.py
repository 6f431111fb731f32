"""The pack inside real ComfyUI servers, the stock 0.3.75 and 0.33.0: loaded by their own loaders, listed in
/object_info, and the bundled Wan 2.2 workflow (converted by tools/workflow_api.py) queued through /prompt with tiny
random-weight models of the real architectures. The same prompt without Patch Attention gives the same latents.

The tiny DiT's attention is sharp (tools.fixtures.tiny_models: qk_gain), so its sampled latents depend strongly on it:
replacing attention by uniform weights moves them by about half their standard deviation, while the pack and
ComfyUI's own attention agree to fp32 rounding. The comparison is on the saved latents, not on the 8-bit frames of
the tiny VAE (which are near-flat grey)."""
import json
import os

import numpy as np
import pytest
from PIL import Image

from comfy_harness import missing, require_comfy
from tools.comfyui_setup.comfy_server import ComfyServer
from tools.comfyui_setup.comfyui import ROOT, VERSIONS, comfy_path
from tools.comfyui_setup.prompt_tools import output_files, resized, saved_latents, without_patch, workflow_api

WAN_T2V = os.path.join(ROOT, "workflows", "Wan 2.2 5B Text to Video 480p.json")
# fp32 agreement bound for the final latents, relative to their largest magnitude: the pack and ComfyUI's attention
# differ by rounding (~1e-6 relative per call), amplified by 2 sampler steps and cfg; uniform attention gives ~0.3
LATENT_RTOL = 1e-4


@pytest.fixture(scope="module", params=VERSIONS, ids=lambda v: f"comfyui-{v}")
def server(request, tmp_path_factory):
    version = request.param
    if comfy_path(version) is None:
        missing(f"ComfyUI {version} is not set up: run ./dev test")
    base = tmp_path_factory.mktemp(f"comfy-{version}")
    require_comfy()  # the writers build the real model classes of the in-process ComfyUI
    from tools.fixtures.tiny_models import write_wan22_model_set
    write_wan22_model_set(str(base / "models"))
    srv = ComfyServer(base, version=version)
    srv.start()
    yield srv
    srv.stop()


def test_pack_loads_through_comfyui_loader(server):
    info = server.get("/object_info")
    for name in ("TiledAttentionPatch", "TiledFFNChunking", "TiledAttentionInfo"):
        assert name in info, name
    patch = info["TiledAttentionPatch"]
    assert patch["display_name"] == "Patch Attention (tiled)"
    mode = patch["input"]["required"]["mode"]  # V3 nodes: ["COMBO", {"options": [...]}]
    assert (mode[1].get("options") if mode[0] == "COMBO" else mode[0]) == ["auto", "chunked", "online", "inplace",
                                                                           "off"]
    log = server.log()
    # ComfyUI's import report names each custom node folder; ours must not be among the failed ones
    failed = [ln for ln in log.splitlines() if "IMPORT FAILED" in ln or
              ("Cannot import" in ln and "custom_nodes" in ln)]
    assert not [ln for ln in failed if "tiled-attention" in ln], "\n".join(failed)
    assert "[tiled-attention]" in log  # the startup verdict line
    assert not [ln for ln in log.splitlines() if "Cannot import" in ln], "a ComfyUI module failed to import"


def frames(server, entry):
    return [np.asarray(Image.open(f), dtype=np.int16) for f in output_files(server.base, entry, (".png",))]


def test_wan_workflow_end_to_end(server):
    api = workflow_api()
    with open(WAN_T2V) as f:
        workflow = json.load(f)
    prompt = api.workflow_to_prompt(workflow, server.get("/object_info"))
    assert any(n["class_type"] == "TiledAttentionPatch" for n in prompt.values())

    small = dict(size=(64, 64), frames=5, steps=2, min_tokens=0)
    patched = server.run_prompt(resized(prompt, "patched", mode="chunked", **small))
    vids = output_files(server.base, patched, (".mp4", ".webm", ".webp"))
    assert vids and all(os.path.getsize(v) > 0 for v in vids), patched["outputs"]
    assert "tiled attention running (mode chunked)" in server.log()

    plain = server.run_prompt(resized(without_patch(prompt), "plain", **small))
    a, b = frames(server, patched), frames(server, plain)
    assert len(a) == len(b) >= 5
    assert max(int(np.abs(x - y).max()) for x, y in zip(a, b)) <= 1

    (la,), (lb,) = saved_latents(server.base, "patched"), saved_latents(server.base, "plain")
    assert la.shape == lb.shape == (1, 48, 2, 4, 4)
    err = (la - lb).abs().max().item()
    assert err <= LATENT_RTOL * lb.abs().max().item(), f"latents differ by {err} (scale {lb.abs().max():.3f})"


def test_the_demos_busy_verdict_leaves_a_real_server_under_load_out(server, monkeypatch):
    """Issue 38.7, with a real server sampling a prompt (the demo's own run(), which reads other processes'
    runnable threads after each /history request): in every reading the server's process (a child of this one,
    like the demo's servers) is ours, never another's, and it was seen runnable (under load). The verdict, counted
    over the processes this test controls (whatever else runs on the machine is not this test's to judge): with
    the server alone, quiet, not busy; with a real competing program alongside (one detached spinning process per
    core, not ours), busy."""
    import signal
    import subprocess
    import sys

    from attention_core.device import machine_load
    from tools.demo import demo, demo_summary

    class Peak:
        peak = start = 0

        def reset(self):
            pass

        def sample(self):
            pass
    small = dict(size=(64, 64), frames=5, steps=2, min_tokens=0)
    with open(WAN_T2V) as f:
        prompt = workflow_api().workflow_to_prompt(json.load(f), server.get("/object_info"))
    cores, spinners = machine_load.cores(), set()
    scans = []

    def reading():  # what the demo reads, restricted to the server, this process and the spinners
        got = machine_load.runnable_by_process()
        scans.append(got)
        mine = machine_load.own_tree() | spinners
        return sum(n for pid, n in got[0].items() if pid in mine)
    monkeypatch.setattr(machine_load, "others_runnable", reading)
    *_, quiet = demo.run(server, resized(prompt, "busy-quiet", mode="chunked", **small), "quiet", Peak())
    assert quiet and demo_summary.busy_reason(cores, None, quiet) is None, quiet
    assert all(server.proc.pid not in others for others, _ in scans)
    assert any(ours.get(server.proc.pid) for _, ours in scans), "the server was never seen runnable"
    code = ("import os, time\nif os.fork():\n    os._exit(0)\nprint(os.getpid(), flush=True)\n"
            "end = time.time() + 300\nwhile time.time() < end:\n    pass\n")
    starters = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
                for _ in range(cores)]
    spinners.update(int(p.stdout.readline()) for p in starters)
    try:
        scans.clear()
        *_, loaded = demo.run(server, resized(prompt, "busy-loaded", mode="chunked", **small), "loaded", Peak())
        assert "other processes kept" in (demo_summary.busy_reason(cores, None, loaded) or ""), loaded
        assert all(server.proc.pid not in others for others, _ in scans)
    finally:
        for pid in spinners:
            os.kill(pid, signal.SIGKILL)
        for p in starters:
            p.wait()

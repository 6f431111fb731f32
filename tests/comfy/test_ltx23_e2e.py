"""The three bundled LTX-2.3 workflows end to end in the real stock ComfyUI 0.33.0 (the first stock version with the
LTX-2.3 model code): converted by tools/workflow_api.py, shrunk in size only (stage 1 at about 128x96, 9 frames,
2 + 3 steps), queued through /prompt with tiny random-weight LTX-2.3 files under the names the workflows load
(tools/fixtures/tiny_models_ltx23.py). Each writes an mp4 with an audio track; the final video and audio latents with
Patch Attention agree with the same prompt without it (ComfyUI's own fp32 attention); the test shim's attention census
shows the pack's engine computed every DiT attention (video self, audio self, text cross for both, audio<->video cross)
in both stages, stage 2 after the distilled LoRA, and none of them reached ComfyUI's own attention.
A prompt with the engine broken on purpose (uniform attention, heads rotated) must miss the bound by orders of
magnitude: the tiny models' attention is sharp (q/k norm gain 2: score std about 4) so outputs depend on it. (No
attention call of these workflows reaches the engine with a mask: the text padding is stripped and the connectors
fill with registers. A dropped mask is caught where masks do reach it: test_comfy_nodes.py's LTX-Video text mask,
test_attention_routing.py's padded text encoders, the engine's mask tests.)
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from comfy_harness import missing
from tools.comfyui_setup.comfyui import LATEST, ROOT, comfy_path
from tools.comfyui_setup.comfy_server import ComfyServer
from tools.comfyui_setup.prompt_tools import (attention_census, output_files, resized, with_final_latents,
                                              without_patch, workflow_api)

# stage-1 size per workflow: different sizes keep ComfyUI's node cache from reusing one workflow's samples in another
WORKFLOWS = {"LTX-2.3 Text to Video 720p": (128, 96), "LTX-2.3 Text to Video 1080p": (160, 96),
             "LTX-2.3 Image to Video 720p": (128, 96)}
FRAMES, STEPS = 9, 2  # stage 2 keeps the workflows' ManualSigmas: 3 steps
AUDIO_TOKENS = 9  # 9 frames at 25 fps = 0.36 s; the audio VAE gives 16000 / 160 / 4 = 25 latents per second
# Bound: max |patched - plain| <= TOL_EPS * fp32 epsilon * max |plain| (relative to the reference's own magnitude,
# so independent of any BLAS's summation order). Measured: about 7 epsilon; a broken engine: about 0.4 relative.
TOL_EPS = 1000
DIT_SITES = {  # attention modules of LTX-2.3's BasicAVTransformerBlock -> which stream's tokens are the queries
    "attn1": "video", "attn2": "video", "audio_to_video_attn": "video",
    "audio_attn1": "audio", "audio_attn2": "audio", "video_to_audio_attn": "audio"}
BLOCK = "BasicAVTransformerBlock."
BREAKS = ("uniform", "swapheads")


def video_tokens(size, stage):
    """Latent tokens of the video stream: 32x space, 8x time (causal first frame), x2 space in stage 2."""
    return (size[0] // 32 * stage) * (size[1] // 32 * stage) * ((FRAMES - 1) // 8 + 1)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if comfy_path(LATEST) is None:
        missing(f"no ComfyUI {LATEST}: the LTX-2.3 workflows need it (./dev setup)")
    for name in WORKFLOWS:
        if not os.path.exists(os.path.join(ROOT, "workflows", name + ".json")):
            missing(f"workflows/{name}.json not present")
    base = tmp_path_factory.mktemp("comfy_ltx23")
    # written in a child process: it imports ComfyUI 0.33.0, whatever ComfyUI this test process imported
    made = subprocess.run([sys.executable, "-m", "tools.fixtures.tiny_models_ltx23", str(base / "models"),
                           str(base / "input")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, f"tools/fixtures/tiny_models_ltx23.py failed:\n{made.stderr[-3000:]}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TILED_ATTENTION_TEST_CENSUS", "1")
        mp.delenv("TILED_ATTENTION_TEST_BREAK", raising=False)
        srv = ComfyServer(base, version=LATEST)
        srv.start()
    yield srv
    srv.stop()


def latents(server, entry):
    from safetensors.torch import load_file
    found = {}
    for path in output_files(server.base, entry, (".latent",)):
        part = "video" if os.path.basename(path).startswith("video_latent") else "audio"
        found[part] = load_file(path)["latent_tensor"]
    assert set(found) == {"video", "audio"}, entry["outputs"]
    return found


class Runs:
    """Each workflow's prompt, run once per variant (module-wide: one server, every test reads the same runs)."""

    def __init__(self, server):
        self.server, self.done, self.info = server, {}, None

    def prompt(self, name):
        if self.info is None:
            self.info = self.server.get("/object_info")
        with open(os.path.join(ROOT, "workflows", name + ".json")) as f:
            return workflow_api().workflow_to_prompt(json.load(f), self.info)

    def get(self, name, variant):
        key = (name, variant)
        if key not in self.done:
            prompt, size = self.prompt(name), WORKFLOWS[name]
            tag = f"{name}/{variant}"
            if variant == "plain":
                p = resized(without_patch(prompt), tag, size=size, frames=FRAMES, steps=STEPS)
                extra = None
            else:  # a broken run gets its own memory budget so that ComfyUI's cache cannot hand back earlier samples
                budget = 0 if variant == "patched" else 4096 + BREAKS.index(variant)
                p = resized(prompt, tag, size=size, frames=FRAMES, steps=STEPS, mode="chunked", min_tokens=0)
                for node in p.values():
                    if node["class_type"] == "TiledAttentionPatch":
                        node["inputs"]["memory_budget_mb"] = budget
                extra = None if variant == "patched" else {"tiled_attention_test_break": variant}
            pid, entry = self.server.queue_prompt(with_final_latents(p, tag), extra)
            census = attention_census(self.server.log()).get(pid)
            assert census is not None, "no [attention-census] line: is tools/fixtures/tiny_model_loaders loaded?"
            self.done[key] = {"entry": entry, "latents": latents(self.server, entry), "census": census}
        return self.done[key]


@pytest.fixture(scope="module")
def runs(server):
    return Runs(server)


def deviation(a, b):
    """max |a - b| over max |b|, in float64."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max())


BOUND = TOL_EPS * torch.finfo(torch.float32).eps


@pytest.mark.parametrize("name", list(WORKFLOWS))
def test_ltx23_workflow_writes_video_with_audio(runs, name):
    try:
        import av
    except ImportError:
        missing("PyAV (pip package av) is needed to read the mp4: install tests/requirements-test.txt")
    run = runs.get(name, "patched")
    videos = output_files(runs.server.base, run["entry"], (".mp4",))
    assert len(videos) == 1 and os.path.getsize(videos[0]) > 0, run["entry"]["outputs"]
    with av.open(videos[0]) as container:
        assert container.streams.video and container.streams.audio, f"{videos[0]}: streams {container.streams}"
        frames = sum(1 for _ in container.decode(video=0))
        width, height = container.streams.video[0].codec_context.width, container.streams.video[0].codec_context.height
    with av.open(videos[0]) as container:
        samples = sum(frame.samples for frame in container.decode(audio=0))
        rate = container.streams.audio[0].rate
    assert frames == FRAMES, f"{frames} video frames"
    w, h = WORKFLOWS[name]  # stage 2 doubles the stage-1 size; the 1080p workflow then crops 8 rows (1088 -> 1080)
    assert (width, height) == ((2 * w, 2 * h - 8) if "1080p" in name else (2 * w, 2 * h)), (width, height)
    assert samples >= 0.25 * rate, f"audio track of {samples} samples at {rate} Hz (the video lasts 0.36 s)"
    assert run["latents"]["video"].shape[2:] == (2, WORKFLOWS[name][1] // 16, WORKFLOWS[name][0] // 16)
    assert run["latents"]["audio"].shape[2] == AUDIO_TOKENS


@pytest.mark.parametrize("name", list(WORKFLOWS))
def test_ltx23_patch_matches_comfy_attention_and_engine_runs_the_dit(runs, name, record_property):
    patched, plain = runs.get(name, "patched"), runs.get(name, "plain")
    assert "lora key not loaded" not in runs.server.log(), "the distilled LoRA did not apply to the tiny DiT"
    for part in ("video", "audio"):
        dev = deviation(patched["latents"][part], plain["latents"][part])
        record_property(f"{part}_deviation", dev)
        print(f"\n{name}: {part} latents deviate by {dev:.3e} of their max = {dev / BOUND * TOL_EPS:.1f} fp32 eps "
              f"(bound {TOL_EPS})")
        assert dev <= BOUND, f"{name}: {part} latents differ by {dev:.3e} of their max (bound {BOUND:.3e})"

    engine, bypass = patched["census"]["engine"], patched["census"]
    size = WORKFLOWS[name]
    stage_tokens = {video_tokens(size, 1), video_tokens(size, 2)}
    calls = {}
    for attr, stream in DIT_SITES.items():
        per_len = engine.get(BLOCK + attr, {})
        calls[attr] = sum(per_len.values())
        expected = stage_tokens if stream == "video" else {AUDIO_TOKENS}
        assert set(per_len) == expected, f"{name}: engine calls of {BLOCK + attr} by query length {per_len}, " \
                                         f"expected lengths {sorted(expected)} (stage 1 and stage 2 after the LoRA)"
    assert len(set(calls.values())) == 1, f"{name}: uneven engine calls per DiT attention {calls}"
    dit_bypass = {s: n for kind in ("comfy", "torch_sdpa") for s, n in bypass[kind].items() if s.startswith(BLOCK)}
    assert not dit_bypass, f"{name}: DiT attention reached ComfyUI's own attention: {dit_bypass}"
    # the census does see ComfyUI's attention: without the patch the same DiT calls land there
    plain_dit = {s: sum(n.values()) for s, n in plain["census"]["comfy"].items() if s.startswith(BLOCK)}
    assert plain_dit == {BLOCK + a: n for a, n in calls.items()}, (plain_dit, calls)
    # Not yet routed through the pack (another change does it); reported, not asserted:
    others = {kind: {s: sum(n.values()) for s, n in bypass.get(kind, {}).items()}
              for kind in ("comfy", "comfy_masked", "torch_sdpa")}
    record_property("bypasses", json.dumps(others))
    print(f"\n{name}: engine {calls} per DiT attention; outside the pack: {json.dumps(others)}")


@pytest.mark.parametrize("how", BREAKS)
def test_ltx23_comparison_notices_a_broken_engine(runs, how):
    name = "LTX-2.3 Text to Video 720p"
    broken, plain = runs.get(name, how), runs.get(name, "plain")
    assert sum(sum(n.values()) for n in broken["census"]["engine"].values()) > 0
    for part in ("video", "audio"):
        dev = deviation(broken["latents"][part], plain["latents"][part])
        print(f"\n{how}: {part} deviation {dev:.3e} (bound {BOUND:.3e})")
        assert dev > 100 * BOUND, f"engine broken ({how}) yet {part} latents within {dev:.3e} of the reference"

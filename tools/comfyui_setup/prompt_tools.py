"""Editing API-format prompts of the bundled workflows (Wan 2.2 5B and 14B, LTX-2.3, Z-Image Turbo): test sizes, removing Patch Attention,
saving the final latents, reading outputs and the test shim's attention census."""
import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/<group>/x.py


def workflow_api():
    """tools/workflow_api.py, the UI -> API converter (stdlib only)."""
    from .. import workflow_api as mod
    return mod


def _ltx_base_size(prompt):
    """(width, height) of the first EmptyLTXVLatentVideo: the workflow's stage-1 size, that the x2 stage 2 doubles."""
    for node in prompt.values():
        if node["class_type"] == "EmptyLTXVLatentVideo":
            return node["inputs"]["width"], node["inputs"]["height"]
    return None


def resized(prompt, prefix, size=None, frames=None, steps=None, mode=None, min_tokens=None):
    """A copy with the latent size / frames / steps / Patch Attention settings replaced where given, outputs
    under `prefix`. Wan and Z-Image: every decoded frame (image) is also saved as PNG and the latent each decoder reads as
    `<prefix>/latent*.latent` (lossless, for comparisons; `saved_latents` reads them). LTX-2.3: `size` is the
    stage-1 size (EmptyLTXVLatentVideo); the image scale (i2v) and the final crop (1080p) follow it in proportion;
    `steps` sets the stage-1 LTXVScheduler (stage 2's ManualSigmas stay: 3 steps); `frames` sets the video length
    and the audio latent's frame count."""
    p = json.loads(json.dumps(prompt))
    ltx = _ltx_base_size(p)
    for node in p.values():
        ct, inp = node["class_type"], node["inputs"]
        if ct in ("Wan22ImageToVideoLatent", "EmptyLTXVLatentVideo", "EmptyHunyuanLatentVideo", "WanImageToVideo",
                  "EmptySD3LatentImage"):
            if size:
                inp.update(width=size[0], height=size[1])
            if frames and "length" in inp:
                inp.update(length=frames)
        elif ct == "LTXVEmptyLatentAudio" and frames:
            inp["frames_number"] = frames
        elif ct in ("KSampler", "KSamplerAdvanced", "LTXVScheduler") and steps:
            inp["steps"] = steps
        elif ct == "ImageScale" and ltx and size:  # i2v start image: the full (stage-2) size
            inp.update(width=inp["width"] * size[0] // ltx[0], height=inp["height"] * size[1] // ltx[1])
        elif ct == "ImageCrop" and ltx and size:  # 1080p: crop the x2 output by as many pixels as the workflow does
            inp.update(width=2 * size[0] - (2 * ltx[0] - inp["width"]),
                       height=2 * size[1] - (2 * ltx[1] - inp["height"]))
        elif ct == "TiledAttentionPatch":
            if mode:
                inp["mode"] = mode
            if min_tokens is not None:
                inp["min_tokens"] = min_tokens
        elif ct == "VAEDecodeTiled" and size and not ltx:
            inp.update(tile_size=max(64, min(512, max(size) // 32 * 32)), overlap=32, temporal_size=64,
                       temporal_overlap=8)
        elif ct in ("SaveVideo", "SaveAnimatedWEBP", "SaveWEBM"):
            inp["filename_prefix"] = f"{prefix}/video"
    decoders = [nid for nid, n in p.items() if n["class_type"] in ("VAEDecode", "VAEDecodeTiled")]
    if decoders and not ltx:
        p["9001"] = {"class_type": "SaveImage", "inputs": {"images": [decoders[0], 0],
                                                            "filename_prefix": f"{prefix}/frame"}}
        for i, nid in enumerate(decoders):
            p[str(9100 + i)] = {"class_type": "SaveLatent", "inputs": {"samples": p[nid]["inputs"]["samples"],
                                                                       "filename_prefix": f"{prefix}/latent{i}"}}
    return p


def saved_latents(base, prefix):
    """The latents a prompt made by `resized(..., prefix)` saved, in decoder order, as float32 tensors."""
    import glob

    from safetensors.torch import load_file
    paths = sorted(glob.glob(os.path.join(base, "output", prefix, "latent*.latent")))
    return [load_file(p)["latent_tensor"].float() for p in paths]


def with_final_latents(prompt, prefix):
    """A copy that also saves (SaveLatent) the video and audio latents the LTX-2.3 workflow decodes: the outputs
    of the LTXVSeparateAVLatent that feeds the video decoder, as `{prefix}/video_latent` and `{prefix}/audio_latent`."""
    p = json.loads(json.dumps(prompt))
    decoders = [n for n in p.values() if n["class_type"] in ("VAEDecode", "VAEDecodeTiled")]
    sources = {str(n["inputs"]["samples"][0]) for n in decoders}
    separators = [nid for nid in sources if p[nid]["class_type"] == "LTXVSeparateAVLatent"]
    if len(separators) != 1:
        raise ValueError("with_final_latents: expected one LTXVSeparateAVLatent feeding the video decoder, found "
                         f"{separators}")
    for slot, name in ((0, "video_latent"), (1, "audio_latent")):
        p[f"910{slot}"] = {"class_type": "SaveLatent", "inputs": {"samples": [separators[0], slot],
                                                                  "filename_prefix": f"{prefix}/{name}"}}
    return p


def without_patch(prompt):
    """The same prompt with every TiledAttentionPatch node removed and its consumers wired to its input."""
    p = json.loads(json.dumps(prompt))
    for nid in [n for n, node in p.items() if node["class_type"] == "TiledAttentionPatch"]:
        source = p.pop(nid)["inputs"]["model"]
        for node in p.values():
            for k, v in node["inputs"].items():
                if isinstance(v, list) and len(v) == 2 and str(v[0]) == nid:
                    node["inputs"][k] = source
    return p


def output_files(base, entry, suffixes):
    """Paths of the files a finished prompt wrote, from its history entry."""
    found = []
    for node_out in entry["outputs"].values():
        for key in ("images", "videos", "gifs", "video", "latents", "audio"):
            for item in node_out.get(key, []) or []:
                if isinstance(item, dict) and item.get("filename", "").endswith(suffixes):
                    found.append(os.path.join(base, item.get("type", "output"), item.get("subfolder", ""),
                                              item["filename"]))
    return found


def attention_census(log_text):
    """The test shim's per-prompt attention counts from a server log
    (tools/fixtures/tiny_model_loaders/attention_census.py, loaded by path: its package imports ComfyUI)."""
    path = os.path.join(ROOT, "tools", "fixtures", "tiny_model_loaders", "attention_census.py")
    spec = importlib.util.spec_from_file_location("tiny_model_loaders_attention_census", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.parse_log(log_text)

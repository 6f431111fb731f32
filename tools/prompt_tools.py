"""Editing API-format prompts of the bundled workflows: test sizes, removing Patch Attention, reading outputs."""
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def workflow_api():
    """tools/workflow_api.py, the UI -> API converter (stdlib only)."""
    from . import workflow_api as mod
    return mod


def resized(prompt, prefix, size=None, frames=None, steps=None, mode=None, min_tokens=None):
    """A copy with the latent size / frames / steps / Patch Attention settings replaced where given, outputs
    under `prefix`, every decoded frame also saved as PNG and the latent each decoder reads saved as
    `<prefix>/latent*.latent` (lossless, for comparisons)."""
    p = json.loads(json.dumps(prompt))
    for node in p.values():
        ct, inp = node["class_type"], node["inputs"]
        if ct == "Wan22ImageToVideoLatent":
            if size:
                inp.update(width=size[0], height=size[1])
            if frames:
                inp.update(length=frames)
        elif ct in ("KSampler", "KSamplerAdvanced") and steps:
            inp["steps"] = steps
        elif ct == "TiledAttentionPatch":
            if mode:
                inp["mode"] = mode
            if min_tokens is not None:
                inp["min_tokens"] = min_tokens
        elif ct == "VAEDecodeTiled" and size:
            inp.update(tile_size=max(64, min(512, max(size) // 32 * 32)), overlap=32, temporal_size=64,
                       temporal_overlap=8)
        elif ct in ("SaveVideo", "SaveAnimatedWEBP", "SaveWEBM"):
            inp["filename_prefix"] = f"{prefix}/video"
    decoders = [nid for nid, n in p.items() if n["class_type"] in ("VAEDecode", "VAEDecodeTiled")]
    if decoders:
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
        for key in ("images", "videos", "gifs", "video"):
            for item in node_out.get(key, []) or []:
                if isinstance(item, dict) and item.get("filename", "").endswith(suffixes):
                    found.append(os.path.join(base, item.get("type", "output"), item.get("subfolder", ""),
                                              item["filename"]))
    return found

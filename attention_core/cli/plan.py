"""Will it fit: tokens and per-call memory of a video model's attention and feed-forward, before running anything.

    python -m attention_core.plan --model wan22-5b --width 1280 --height 720 --frames 121 [--free-gb 32]

Tokens follow each model's latent rules: latent frames = 1 + (F - 1) // t, latent rows = H // s, columns W // s
(VAE compression t x s x s), then the DiT's patch (pt, ps, ps) pads up: tokens = ceil(lf/pt)*ceil(lh/ps)*ceil(lw/ps)
(an image model, Z-Image Turbo: frames 1, plus the text tokens that join its self-attention).
Score memory of one self-attention call (batch item count `batch`, h heads, N tokens, e bytes per element):
  math SDPA             scores + softmax output: 2 * b*h * N * N * e
  ComfyUI sub-quadratic its own rule (comfy/ldm/modules/sub_quadratic_attention.py + attention.py): the largest
                        query chunk x in (4096, 2048, 1024, 512, 256) with 4 * b*h * x * N * e <= free, full key
                        rows; else 512 rows x sqrt(N) keys; scores + probabilities: 2 * b*h * x * N * e
  ComfyUI split         3 * b*h * N * N * e needed; 2^ceil(log2(need / free)) slices (refuses over 64), and only
                        when N divides by the slice count (else one slice: the whole matrix); 2 * slice scores
  this pack             the engine's tile (kernel.memory: sized by bytes_per_score) at the bytes a score it holds
                        (score_bytes) * b*h_tile * rows * keys, + its rows' query / output / accumulator
                        tensors (row_bytes), K/V copies, the fp16 guard's fp32 K (a head-split tile writes its
                        group's results straight into the call's output: nothing more)
FFN hidden activation: 2 * b * N * ffn_width * e (before and after the GELU), divided by the chunk count.
Pure arithmetic: no torch import at module level, nothing allocated.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Dict, Optional

GB = 1 << 30
MB = 1 << 20


@dataclass(frozen=True)
class ModelSpec:
    """A video DiT's attention and latent geometry (self-attention over the video tokens)."""
    key: str
    title: str
    vae: tuple            # (time, height, width) compression of the VAE
    patch: tuple          # (time, height, width) patch of the DiT
    heads: int
    head_dim: int
    ffn: int              # hidden width of the block's feed-forward
    layers: int
    source: str           # where these numbers come from
    joint_text: int = 0   # text tokens that join every self-attention call (Z-Image: the prompt's, padded to 32s)

    @property
    def width(self) -> int:
        return self.heads * self.head_dim


MODELS: Dict[str, ModelSpec] = {
    "wan22-5b": ModelSpec(
        "wan22-5b", "Wan 2.2 TI2V 5B", (4, 16, 16), (1, 2, 2), 24, 128, 14336, 30,
        "comfy/ldm/wan/model.py (dim 3072 = 24 x 128, ffn 14336, 30 layers), Wan22ImageToVideoLatent "
        "(48 x (F-1)//4+1 x H//16 x W//16), patch (1, 2, 2)"),
    "wan-14b": ModelSpec(
        "wan-14b", "Wan 2.1 / 2.2 14B", (4, 8, 8), (1, 2, 2), 40, 128, 13824, 40,
        "comfy/ldm/wan/model.py (dim 5120 = 40 x 128, ffn 13824, 40 layers), Wan 2.1 VAE latent "
        "(16 x (F-1)//4+1 x H//8 x W//8), patch (1, 2, 2)"),
    "ltx23-22b": ModelSpec(
        "ltx23-22b", "LTX-2.3 22B (video stream)", (8, 32, 32), (1, 1, 1), 32, 128, 16384, 48,
        "comfy/ldm/lightricks/av_model.py LTXAVModel (video: 32 heads x 128 = 4096, FeedForward mult 4 -> 16384, "
        "48 layers; model_detection.py takes head_dim = attn2.to_k rows // 32), EmptyLTXVLatentVideo "
        "(128 x (F-1)//8+1 x H//32 x W//32), SymmetricPatchifier(1)"),
    "z-image-turbo": ModelSpec(
        "z-image-turbo", "Z-Image Turbo 6B (image)", (1, 8, 8), (1, 2, 2), 30, 128, 10240, 30,
        "comfy/ldm/lumina/model.py NextDiT as model_detection.py builds Z-Image (dim 3840 = 30 x 128, "
        "ffn_dim_multiplier 8/3 -> SwiGLU hidden 10240, 30 layers plus 2 noise and 2 context refiners), "
        "EmptySD3LatentImage (16 x H//8 x W//8), patch 2; the prompt's tokens join the image tokens in every "
        "main layer (assumed 128: a prompt of up to 128 Qwen3 tokens, padded to multiples of 32)", 128),
}

# the pack's tier costs per score element of one tile (mirrors attention_core.kernel.memory.bytes_per_score without
# masks or dropout): chunked holds scores and weights, inplace one tile, online score + fp32 weights and cast
COMFY_SUBQUAD_CHUNKS = (4096, 2048, 1024, 512, 256)
TIERS = ("chunked", "inplace", "online")
# the command line's accepted ranges (beyond any video these models make; the arithmetic holds everywhere in them)
MAX_SIDE, MAX_FRAMES, MAX_BATCH, MIN_FREE_GB, MAX_FREE_GB = 16384, 10000, 256, 1e-6, 1e6
MAX_BLOCKS = max(m.layers for m in MODELS.values())  # --blocks' range; each model then allows its own depth

# benchmark / tuning shapes: name -> (model key in MODELS or None, width, height, frames, [N...], heads, head dim)
PRESETS = {
    "wan22-5b-480p": ("wan22-5b", 832, 480, 41, None, 24, 128),
    "wan22-5b-4096": (None, 0, 0, 0, [4096], 24, 128),
    "wan22-5b-720p": ("wan22-5b", 1280, 720, 121, None, 24, 128),
    "wan-14b-480p": ("wan-14b", 832, 480, 81, None, 40, 128),
    "ltx23-22b-720p": ("ltx23-22b", 1280, 704, 129, None, 32, 128),
    "z-image-turbo-1024": ("z-image-turbo", 1024, 1024, 1, None, 30, 128),
    "z-image-turbo-1536": ("z-image-turbo", 1536, 1536, 1, None, 30, 128),
    "reference": (None, 0, 0, 0, [1024, 2048, 4096], 16, 64),
}


def preset_shapes(name):
    """[(N, heads, head dim)] of a preset; N from the model's latent rules where it names a model."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    model, w, h, f, ns, heads, dim = PRESETS[name]
    if model is not None:
        ns = [tokens(MODELS[model], w, h, f)]
    return [(n, heads, dim) for n in ns]


def latent_shape(model: ModelSpec, width: int, height: int, frames: int) -> tuple:
    """(latent frames, rows, columns) of the empty video latent ComfyUI's node makes for this size."""
    t, s_h, s_w = model.vae
    return 1 + (frames - 1) // t, height // s_h, width // s_w


def _smallest_side(pixels: int, scale: float) -> int:
    """The smallest side s with int(s * scale) >= pixels (a stage's side, as attention_core.estimate.run_time
    scales it)."""
    s = max(1, math.ceil(pixels / scale))
    while int(s * scale) < pixels:
        s += 1
    while s > 1 and int((s - 1) * scale) >= pixels:
        s -= 1
    return s


def _smallest_stage(model: ModelSpec):
    """The sampling stage (attention_core.estimate.STAGES) that runs at the smallest scale of the requested size,
    or None when every stage runs at the full size."""
    from .estimate import STAGES
    stages = [st for st in STAGES.get(model.key, ()) if st.scale < 1]
    return min(stages, key=lambda st: st.scale) if stages else None


def min_size(model: ModelSpec) -> tuple:
    """(width, height, frames): the smallest video whose every sampling stage has at least one token: one VAE
    block (its spatial compression) at the smallest stage's scale (LTX-2.3's first stage samples at half the
    size, so 64 x 64 pixels); any frame count >= 1 gives a latent frame."""
    st = _smallest_stage(model)
    scale = st.scale if st is not None else 1.0
    return _smallest_side(model.vae[2], scale), _smallest_side(model.vae[1], scale), 1


def min_size_reason(model: ModelSpec, pixels: str) -> str:
    """Why min_size is what it is, in words: '... compresses <pixels> pixels into one latent[ and <stage> samples
    at <scale> of the size]'."""
    st = _smallest_stage(model)
    return (f"its VAE compresses {pixels} pixels into one latent"
            + (f" and its {st.name} samples at {st.scale:g} of the size" if st is not None else ""))


def tokens(model: ModelSpec, width: int, height: int, frames: int) -> int:
    """Tokens of one self-attention call: the latent padded up to whole patches, one token per patch, plus the
    text tokens that join it (model.joint_text: Z-Image; 0 for the video models, whose text is cross-attended)."""
    lf, lh, lw = latent_shape(model, width, height, frames)
    pt, ph, pw = model.patch
    latent = math.ceil(lf / pt) * math.ceil(lh / ph) * math.ceil(lw / pw)
    return latent + model.joint_text if latent else 0  # no latent token: no call to join


def tier_bytes_per_score(tier: str, elem: int, cpu: bool = False) -> int:
    """Transient bytes per score of one tile (attention_core.device.tile_bytes.tile_bytes_per_score, no mask or dropout)
    for inputs of `elem` bytes computed as they are; half precision is taken as fp16, whose overflow guard may
    recompute a tile in fp32 (the costlier half)."""
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; choose from {TIERS}")
    from ..device.tile_bytes import tile_bytes_per_score
    return tile_bytes_per_score(tier, elem, elem == 2, "cpu" if cpu else "other")


PRECISIONS = ("auto", "input", "fp16", "fp32")  # the engine's precision modes (attention_core.kernel.numerics)
LAYOUTS = ("comfyui", "heads")  # q/k/v as ComfyUI hands them ([B, N, H*D] viewed as heads) or contiguous heads
DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}


def compute_dtype(dtype: str, cpu: bool, precision: str = "auto") -> str:
    """The dtype the engine's tiles compute in (attention_core.kernel.numerics.choose_numerics, shapes only): half
    inputs compute in fp32 on the CPU under "auto" and always under "fp32"; bf16 -> fp16 under "fp16" (and under
    "auto" on a GPU without bf16 hardware: the planner assumes fp16 there, whose overflow guard costs more)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPE_BYTES)}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose from {', '.join(PRECISIONS)}")
    if dtype == "fp32" or precision == "fp32" or (precision == "auto" and cpu):
        return "fp32"
    if dtype == "bf16" and precision == "input":
        return "bf16"
    return "fp16"


def score_bytes(tier: str, compute: str, cpu: bool = False) -> int:
    """Bytes per score one tile holds at its peak when the tiles compute in `compute`, and what the engine sizes its
    tiles by (attention_core.device.tile_bytes.tile_bytes_per_score without mask or dropout: fp16 tiles the overflow
    guard flags hold fp32 scores and their fp16 cast; chunked S and P share one buffer on the CPU)."""
    from ..device.tile_bytes import tile_bytes_per_score
    return tile_bytes_per_score(tier, DTYPE_BYTES[compute], compute == "fp16", "cpu" if cpu else "other")


def kv_copy_bytes(batch: int, heads: int, n: int, head_dim: int, dtype: str, compute: str, layout: str,
                  all_heads: bool) -> int:
    """K and V as the tiles read them (attention_core.kernel.tiles.TileSource): copied once per call (per head group)
    in the compute dtype when they are not already contiguous heads in that dtype: ComfyUI's layout is a
    transposed view of [B, N, H*D], a head group of a batch > 1 is a strided slice, and half inputs computed in
    fp32 (the CPU default) are converted. `heads`: the kv heads of one head group."""
    copied = layout == "comfyui" or compute != dtype or (batch > 1 and not all_heads)
    return 2 * batch * heads * n * head_dim * DTYPE_BYTES[compute] if copied else 0


# fp32 row statistics a tile row holds at most at once besides its head_dim-wide tensors (row max, row sum, the
# running max and its safe copy, the rescale factor, log l), in bytes
ROW_STATS_BYTES = 8 * 4


def row_bytes(tier: str, compute: str, dtype: str, head_dim: int) -> int:
    """Bytes the engine holds per tile row (one query row of one head of one batch item) besides the scores, at the
    worst moment of its loop (attention_core/kernel/tiers/*.py). c: the compute dtype's bytes; q: the query tile's
    (c, or 4 in fp16, whose overflow guard may run a tile in fp32); t: q when the query tile is a converted copy
    (q.to(...), then times scale), else 0; x: head_dim.
      chunked  two query tiles while the next one is made (the old one is still bound to the loop variable) with
               the previous output (c x) still bound, or one query tile and two outputs while the next output is
               made: max(2 q + t + c, q + 2 c) x
      inplace  the query tile, the output of P V (c x) and its fp32 normalised copy (4 x), with the previous
               tile's fp32 output still bound or, when c is 2, an fp32 temporary: (q + c + 4 + (4 if c == 2)) x
      online   the query tile, the fp32 accumulator and two P V products (the previous one still bound; fp32 in
               fp16, whose guard may ask for it) while a key tile runs, or two query tiles (+ t), two accumulators
               and a product when the next query tile starts: max(q + 4 + 2 p, 2 q + t + 8 + p) x
    plus ROW_STATS_BYTES. The whole output and its row statistics are not counted (the plan's "beyond q, k, v and
    the output")."""
    c = DTYPE_BYTES[compute]
    q = 4 if compute == "fp16" else c
    t = q if (compute != dtype or compute == "fp16") else 0
    if tier == "chunked":
        per = max(2 * q + t + c, q + 2 * c)
    elif tier == "inplace":
        per = q + c + 4 + (4 if c == 2 else 0)
    elif tier == "online":
        p = 4 if compute == "fp16" else c
        per = max(q + 4 + 2 * p, 2 * q + t + 8 + p)
    else:
        raise ValueError(f"unknown tier {tier!r}; choose from {TIERS}")
    return per * head_dim + ROW_STATS_BYTES


def guard_bytes(batch: int, heads: int, n: int, head_dim: int, compute: str) -> int:
    """fp16 tiles' overflow guard: the row-norm bound of K (then Q) of a head group reads an fp32 copy of it before
    the tiles run, and a tile the guard runs in fp32 reads K through an fp32 copy kept for the rest of the call
    (TileSource.k32): 4 x B x H x N x D bytes alongside the tiles."""
    return 4 * batch * heads * n * head_dim if compute == "fp16" else 0


def math_bytes(bh: int, n: int, elem: int) -> int:
    """torch math SDPA: the score matrix and its softmax, both b*h x N x N."""
    return 2 * bh * n * n * elem


def comfy_subquad(bh: int, n: int, elem: int, free: int) -> dict:
    """ComfyUI's attention_sub_quad chunking (attention.py): query chunk x, key chunk, and the transient bytes."""
    for x in COMFY_SUBQUAD_CHUNKS:
        if free / (bh * elem * x * 4.0) >= n:
            q_chunk, kv_chunk = min(x, n), n
            break
    else:
        q_chunk, kv_chunk = min(512, n), min(n, int(math.sqrt(n)))
    return {"q_chunk": q_chunk, "kv_chunk": kv_chunk, "bytes": 2 * bh * q_chunk * kv_chunk * elem}


def comfy_split(bh: int, n: int, elem: int, free: int) -> dict:
    """ComfyUI's attention_split: slice count from 3x the score matrix over free memory; refuses above 64 slices;
    only slices when N divides by the count (else the whole matrix at once)."""
    need = 3 * bh * n * n * elem
    steps = 1 if need <= free else 2 ** math.ceil(math.log2(need / free))
    if steps > 64:
        return {"steps": steps, "rows": None, "bytes": None, "error": "refuses: more than 64 slices needed"}
    rows = n // steps if n % steps == 0 else n
    return {"steps": steps, "rows": rows, "bytes": 2 * bh * rows * n * elem}


def pack_tile(tier: str, bh_kv: int, g: int, n: int, elem: int, budget: int, cpu: bool,
              per: Optional[int] = None, head_dim: Optional[int] = None) -> Optional[dict]:
    """The tile the pack's planner takes for `tier` within `budget` bytes: attention_core.kernel.memory.forward_tile, the
    engine's own rule (about TARGET_TILE_ELEMS scores, ONLINE_TILE_ELEMS for online, all heads when that leaves >= PREF_ROWS rows each, else
    fewer heads; heads of `head_dim` <= HEAD_CAP_MAX_DIM dims capped per head); None when not even MIN_BLOCK rows
    fit."""
    from ..kernel.memory import forward_tile
    per = per or tier_bytes_per_score(tier, elem, cpu)
    t = forward_tile(n, bh_kv, g, per, budget, n, "cpu" if cpu else "other", tier, head_dim=head_dim)
    if t is None:
        return None
    rows, bk, heads = t
    return {"rows": rows, "keys": bk, "heads": heads, "bytes": per * g * rows * bk * heads}


def pack_floor(tier: str, n: int, elem: int, cpu: bool = False, per: Optional[int] = None) -> int:
    """The least budget a tier can run with (the engine's sizing rule): one head, MIN_BLOCK rows, full key rows
    (chunked/inplace) or MIN_BLOCK keys (online), at `per` bytes a score (default: tier_bytes_per_score of `elem`;
    estimate passes score_bytes of the compute dtype, as it does for the tile)."""
    from ..kernel.memory import MIN_BLOCK
    keys = n if tier != "online" else MIN_BLOCK
    return (per or tier_bytes_per_score(tier, elem, cpu)) * MIN_BLOCK * keys


def ffn_bytes(batch: int, n: int, ffn: int, elem: int, chunks: int = 1) -> int:
    """Hidden activation of one feed-forward call, before and after its GELU, over N / chunks tokens."""
    return 2 * batch * math.ceil(n / max(1, chunks)) * ffn * elem


def ffn_auto_chunks(batch: int, n: int, ffn: int, elem: int, free: int) -> int:
    """FFN Chunking's chunks = 0 rule (attention_core.ffn.chunking.AUTO_SHARE of free memory per chunk)."""
    from ..ffn.chunking import AUTO_SHARE
    return max(1, min(n, math.ceil(ffn_bytes(batch, n, ffn, elem) / max(1, free * AUTO_SHARE))))


def detected_free() -> tuple:
    """(bytes free, where): the first GPU's free memory, else available RAM."""
    from ..kernel.memory import free_memory
    import torch
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    free = free_memory(dev)
    return (free if free is not None else 4 * GB), ("GPU " + torch.cuda.get_device_name(dev)) \
        if dev.type == "cuda" else "CPU RAM (available)"


def estimate(model: str, width: int, height: int, frames: int, free: int, dtype_bytes: int = 2, batch: int = 1,
             cpu: bool = False, dtype: Optional[str] = None, precision: str = "auto",
             layout: str = "comfyui") -> dict:
    """Everything the plan prints, as numbers (bytes): tokens, per-call memory of each method, FFN, advice.

    dtype ("fp16", "bf16", "fp32"; default from dtype_bytes), precision (the engine's mode) and layout (how q/k/v
    arrive: "comfyui" inside ComfyUI, "heads" contiguous [B, H, N, D]) decide the K/V copies each tier's total
    counts on top of its tile."""
    from ..kernel.memory import FREE_FRACTION
    if model not in MODELS:
        raise ValueError(f"attention_core.plan: unknown model {model!r}; choose from {', '.join(MODELS)}")
    spec = MODELS[model]
    least = min_size(spec)
    if any(x < m for x, m in zip((width, height, frames), least)):
        raise ValueError(f"attention_core.plan: {spec.title} needs width >= {least[0]}, height >= {least[1]} and "
                         f"frames >= 1 ({min_size_reason(spec, f'{spec.vae[2]}x{spec.vae[1]}')}; smaller has no "
                         f"tokens), got {width}x{height}x{frames}")
    n = tokens(spec, width, height, frames)
    bh = batch * spec.heads
    e = dtype_bytes
    budget = int(free * FREE_FRACTION["cpu" if cpu else "other"])
    dtype = dtype or ("fp32" if e == 4 else "fp16")
    if layout not in LAYOUTS:
        raise ValueError(f"attention_core.plan: unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    compute = compute_dtype(dtype, cpu, precision)
    tiers = {}
    for t in TIERS:
        per = score_bytes(t, compute, cpu)
        tile = pack_tile(t, spec.heads, batch, n, e, budget, cpu, per=per, head_dim=spec.head_dim)
        tiers[t] = {"tile": tile, "floor": pack_floor(t, n, e, cpu, per=per)}
        if tile is not None:  # the engine's tile, with the bytes it holds (it budgets score_bytes a score)
            tile["bytes"] = score_bytes(t, compute, cpu) * batch * tile["rows"] * tile["keys"] * tile["heads"]
            # what the call holds beyond q, k, v and the output: K/V copies, the fp16 guard's fp32 K, the tile and
            # its rows (a head-split call writes each group's results into the call's output: no group output)
            h = tile["heads"]
            copies = kv_copy_bytes(batch, h, n, spec.head_dim, dtype, compute, layout, h >= spec.heads)
            rows = batch * h * tile["rows"] * row_bytes(t, compute, dtype, spec.head_dim)
            guard = guard_bytes(batch, h, n, spec.head_dim, compute)
            tiers[t].update(copies=copies, rows=rows, guard=guard, total=copies + guard + tile["bytes"] + rows)
    auto = next((t for t in TIERS if tiers[t]["tile"] is not None), None)
    chunks = ffn_auto_chunks(batch, n, spec.ffn, e, free)
    return {
        "model": spec, "width": width, "height": height, "frames": frames, "latent": latent_shape(spec, width, height,
                                                                                                  frames),
        "tokens": n, "batch": batch, "dtype_bytes": e, "free": free, "budget": budget,
        "dtype": dtype, "precision": precision, "layout": layout, "compute": compute,
        "scores": bh * n * n * e,
        "math": math_bytes(bh, n, e),
        "subquad": comfy_subquad(bh, n, e, free),
        "split": comfy_split(bh, n, e, free),
        "tiers": tiers, "auto_tier": auto,
        "ffn_full": ffn_bytes(batch, n, spec.ffn, e), "ffn_chunks": chunks,
        "ffn_chunked": ffn_bytes(batch, n, spec.ffn, e, chunks),
        "qkvo": 4 * batch * n * spec.width * e,
    }


def _gb(b) -> str:
    if b is None:
        return "-"
    if b >= 0.1 * GB:
        return f"{b / GB:,.2f} GB"
    return f"{b / MB:,.1f} MB" if b >= 0.1 * MB else f"{b / 1024:,.1f} KB"


def report(est: dict) -> str:
    """The plan as text: one line a number, then what to set."""
    s, n, free = est["model"], est["tokens"], est["free"]
    lf, lh, lw = est["latent"]
    dt = {2: "fp16/bf16", 4: "fp32"}.get(est["dtype_bytes"], f"{est['dtype_bytes']}-byte")
    out = [f"{s.title} at {est['width']}x{est['height']}, {est['frames']} frames ({dt}, batch {est['batch']}, "
           f"free {_gb(free)})",
           f"  latent {lf} x {lh} x {lw} (VAE {s.vae[0]}x{s.vae[1]}x{s.vae[2]}), patch "
           f"{s.patch[0]}x{s.patch[1]}x{s.patch[2]} -> "
           + (f"{n:,} tokens ({n - s.joint_text:,} image + {s.joint_text} text)" if s.joint_text
              else f"{n:,} video tokens") + f"; {s.heads} heads x {s.head_dim}",
           f"  q, k, v in {'ComfyUI' if est['layout'] == 'comfyui' else 'contiguous heads'} layout; "
           f"tiles compute in {est['compute']} (precision {est['precision']})",
           "", "  memory of one self-attention call (transient, beyond q, k, v and the output):",
           f"    score matrix itself          {_gb(est['scores'])}",
           f"    torch math SDPA              {_gb(est['math'])}"
           + ("   DOES NOT FIT" if est["math"] > free else "")]
    sq = est["subquad"]
    out.append(f"    ComfyUI sub-quadratic        {_gb(sq['bytes'])}   ({sq['q_chunk']} query rows x "
               f"{sq['kv_chunk']} keys per chunk at this free memory)" + ("   DOES NOT FIT" if sq["bytes"] > free
                                                                         else ""))
    sp = est["split"]
    if sp.get("error"):
        out.append(f"    ComfyUI split                {sp['error']} ({sp['steps']})")
    else:
        note = "" if sp["rows"] != n or sp["steps"] == 1 else f"; N does not divide by {sp['steps']}: no slicing"
        out.append(f"    ComfyUI split                {_gb(sp['bytes'])}   ({sp['steps']} slice(s) of {sp['rows']} "
                   f"rows{note})" + ("   DOES NOT FIT" if sp["bytes"] > free else ""))
    for t in TIERS:
        tile, floor = est["tiers"][t]["tile"], est["tiers"][t]["floor"]
        shown = (f"{_gb(tile['bytes'])}   ({tile['heads']} head(s) x {tile['rows']} rows x {tile['keys']} keys; "
                 f"least it can run with: {_gb(floor)})") if tile else f"does not fit (needs {_gb(floor)})"
        out.append(f"    this pack: {t:<8}          {shown}")
        if tile and est["tiers"][t]["total"] != tile["bytes"]:
            tt = est["tiers"][t]
            parts = [f"K/V copies {_gb(tt['copies'])} ({est['compute']}, {tile['heads']} head(s))"] \
                if tt["copies"] else []
            if tt["guard"]:
                parts.append(f"fp16 guard's fp32 K {_gb(tt['guard'])}")
            parts.append(f"query/output rows {_gb(tt['rows'])}")
            line, total = f"      + {', '.join(parts)}", f"-> {_gb(tt['total'])} in all"
            out += [f"{line} {total}"] if len(line) + len(total) < 116 else [line, f"        {total}"]
    out += ["", "  feed-forward hidden activation (per block call):",
            f"    unchunked                    {_gb(est['ffn_full'])}   ({n:,} tokens x {s.ffn:,} x 2)",
            f"    FFN Chunking (auto)          {_gb(est['ffn_chunked'])}   ({est['ffn_chunks']} chunk(s))",
            f"    q, k, v, o of one call       {_gb(est['qkvo'])}", "",
            "  recommended:"]
    if est["auto_tier"] is None:
        out.append("    nothing fits: fewer frames, lower resolution, or free memory (--lowvram, --reserve-vram)")
    else:
        tile = est["tiers"][est["auto_tier"]]["tile"]
        out.append(f"    Patch Attention mode auto, memory_budget_mb 0 (auto picks '{est['auto_tier']}', tile "
                   f"{_gb(tile['bytes'])} of a {_gb(est['budget'])} budget, "
                   f"{_gb(est['tiers'][est['auto_tier']]['total'])} in all); FFN Chunking chunks 0 "
                   f"({est['ffn_chunks']} at this free memory)")
        if est["math"] > free:
            out.append(f"    without the pack: math SDPA needs {_gb(est['math'])} > {_gb(free)} free; "
                       + (f"ComfyUI's sub-quadratic fits with {_gb(sq['bytes'])} per call" if sq["bytes"] <= free
                          else f"ComfyUI's sub-quadratic does not fit either ({_gb(sq['bytes'])} per call)"))
        if est["qkvo"] > free:
            out.append(f"    but q, k, v and o of one call alone take {_gb(est['qkvo'])} > {_gb(free)} free: the model "
                       "cannot run at this size in this memory (fewer frames, lower resolution, or free memory)")
    return "\n".join(out)


def time_report(est: dict, calibration: Optional[str] = None, steps=None, cpu: bool = False,
                device: Optional[str] = None, blocks: Optional[int] = None) -> str:
    """The time section (attention_core.estimate.report) for `est`, from the calibration file `calibration` or
    the one of `device` (default: the first GPU, else the CPU; --cpu: the CPU) in the tiles' compute dtype;
    blocks: the DiT blocks a step runs (default: all of the model's; 1 to compare with a one-block demo)."""
    from ..device import calibration as cal_file
    from . import cli_args, estimate as est_mod
    if calibration is None:
        if device is None:
            device = "cpu" if cpu else cli_args.default_device()
        calibration = cal_file.calibration_path(device, compute_dtype(est["dtype"], device == "cpu",
                                                                       est["precision"]))
    return est_mod.report(est["model"], est["width"], est["height"], est["frames"], cal_file.load(calibration),
                          calibration, steps, est["batch"], tokens, blocks)


def main(argv=None) -> int:
    from . import cli_args
    ap = cli_args.Parser(prog="python -m attention_core.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, choices=sorted(MODELS))
    ap.add_argument("--width", type=cli_args.int_range(1, MAX_SIDE), required=True, help=f"pixels, up to {MAX_SIDE}")
    ap.add_argument("--height", type=cli_args.int_range(1, MAX_SIDE), required=True, help=f"pixels, up to {MAX_SIDE}")
    ap.add_argument("--frames", type=cli_args.int_range(1, MAX_FRAMES), required=True, help=f"up to {MAX_FRAMES}")
    ap.add_argument("--free-gb", type=cli_args.float_range(MIN_FREE_GB, MAX_FREE_GB, " GB"), default=None,
                    help=f"free memory in GB, {MIN_FREE_GB:.6f} to {MAX_FREE_GB:,.0f} (default: detected)")
    ap.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default="fp16")
    ap.add_argument("--batch", type=cli_args.int_range(1, MAX_BATCH), default=1,
                    help=f"batch items per call (CFG without batching: 1), up to {MAX_BATCH}")
    ap.add_argument("--cpu", action="store_true", help="plan tiles by the CPU rules instead of the GPU ones")
    ap.add_argument("--precision", choices=PRECISIONS, default="auto",
                    help="the engine's precision mode (Patch Attention's half_precision keep = auto)")
    ap.add_argument("--layout", choices=LAYOUTS, default="comfyui",
                    help="q/k/v as ComfyUI hands them (default) or contiguous [B, H, N, D] heads")
    ap.add_argument("--steps", default=None,
                    help="sampling steps per stage, comma-separated (default: the bundled workflows': wan 20, "
                         "ltx23 20,3)")
    ap.add_argument("--blocks", type=cli_args.int_range(1, MAX_BLOCKS), default=None,
                    help="DiT blocks a step runs, to compare with a run of fewer blocks (./dev demo runs 1, --full "
                         "2): each time is then for that many; default: all of the model's (" +
                         ", ".join(f"{k} {m.layers}" for k, m in MODELS.items()) + ")")
    ap.add_argument("--calibration", default=None,
                    help="calibration file for the time estimate (default: this device's, from "
                         "python -m attention_core.calibrate)")
    a = ap.parse_args(argv)
    if a.calibration is not None:  # a file named on the command line: a broken one is an error, not a warning
        from ..device.calibration import problem
        bad = problem(a.calibration)
        if bad:
            cli_args.fail(ap, "--calibration", f"{bad} (make a new one with python -m attention_core.calibrate "
                                               "--out FILE)")
    spec = MODELS[a.model]
    for flag, value, least, vae in zip(("--width", "--height"), (a.width, a.height), min_size(spec),
                                       (spec.vae[2], spec.vae[1])):
        if value < least:
            cli_args.fail(ap, flag, f"{spec.title} needs at least {least} pixels ({min_size_reason(spec, str(vae))}, "
                                    f"so fewer give no video tokens), got {value}")
    if a.blocks is not None and a.blocks > spec.layers:
        cli_args.fail(ap, "--blocks", f"{spec.title} has {spec.layers} blocks; give a whole number from 1 to "
                                      f"{spec.layers}, got {a.blocks}")
    from .estimate import STAGES
    try:
        steps = None if a.steps is None else [int(x) for x in a.steps.split(",")]
        if steps is not None and (len(steps) != len(STAGES[a.model]) or min(steps) < 1 or max(steps) > 10000):
            raise ValueError
    except ValueError:
        cli_args.fail(ap, "--steps", f"give {len(STAGES[a.model])} comma-separated step count(s) from 1 to 10000 "
                                     f"for {a.model} ({', '.join(st.name for st in STAGES[a.model])}), got {a.steps!r}")
    if a.free_gb is not None:
        free, where = int(a.free_gb * GB), "given"
    else:
        free, where = detected_free()
    est = estimate(a.model, a.width, a.height, a.frames, free, 4 if a.dtype == "fp32" else 2, a.batch, a.cpu,
                   dtype=a.dtype, precision=a.precision, layout=a.layout)
    print(report(est))
    print(f"\n  (free memory: {where}; numbers per attention call and per batch item x {a.batch})")
    print("\n" + time_report(est, a.calibration, steps, cpu=a.cpu, blocks=a.blocks))
    return 0


if __name__ == "__main__":
    sys.exit(main())

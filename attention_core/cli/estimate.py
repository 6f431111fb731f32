"""How long a step and a run take, from a model spec (attention_core.plan's ModelSpec, passed in) and a device
calibration (attention_core.calibrate). Pure arithmetic: no torch import, nothing measured, no attention_core
import (attention_core.plan shows these numbers, so this module must not import it).

FLOPs of one DiT block for one batch item (N video tokens, width C = heads x head_dim, FFN width F, L text
tokens):
  self-attention projections  q, k, v, out: 4 * 2*N*C*C
  cross-attention projections q, out over the video tokens: 2 * 2*N*C*C; k, v over the text: 2 * 2*L*C*C
  self-attention core         Q K^T and P V: 2 * 2*N*N*C
  cross-attention core        2 * 2*N*L*C
  feed-forward                up and down: 2 * 2*N*C*F
Elementwise work of the same block (memory-bound passes: elements read plus elements written, counted from
comfy/ldm/wan/model.py WanAttentionBlock; used for every model: LTX-2.3's video blocks run the same kinds of
passes, norms, modulation, RoPE, residual adds and a GELU, and its audio stream is not counted, as above):
  norms       LayerNorm norm1, norm3, norm2 and RMSNorm of q, k (self) and q (cross): 6 * 2*N*C; RMSNorm of the
              text keys: 2*L*C
  modulation  two modulations addcmul(shift, norm(x), 1 + scale): 2 * 2*N*C; three residual adds (the gated
              addcmul twice, the cross-attention add once), each reading x and y and writing x: 3 * 3*N*C
  RoPE        on q and k (comfy/ldm/flux/math.py _apply_rope1: a multiply writing the rotated pairs, then an
              in-place multiply-add): 2 * 5*N*C
  layout      the attention's inputs from ComfyUI's [B, N, H*D] to heads and its output back (q, k, v and the
              output of self-attention: 4 * 2*N*C; q and the output of cross-attention: 2 * 2*N*C; the text's k,
              v: 2 * 2*L*C); the calibrated attention rates are measured on inputs already in heads
  activation  the GELU over the FFN's hidden activation: 2*N*F
(The GEMMs' bias adds are fused into them, and the modulation vectors are B x 6 x C: not counted.)
A step runs `blocks` blocks (default: all of the model's layers) for each batch item (2 with CFG: the conditional
and unconditional passes, one batch of 2 N rows in each linear layer); a run is the steps of each stage (LTX-2.3:
20 CFG steps at half size, then 3 steps at full size without CFG). Times are work over the calibration's
measured rates: each linear layer at the GEMM rate measured for the nearest shape (k and n by ratio; a
transposed shape counts as near as its own when its own was not measured), log-log interpolated over the
measured row counts (the model's rows: N tokens x the batch; flat outside the measured rows); attention at the
rate measured for that method at the nearest token counts (log-log interpolation, the largest measured beyond
the last); elementwise passes at the calibration's elementwise bandwidth (GB/s), or, in a calibration made before
it was measured, an assumed DEFAULT_FLOPS_PER_BYTE below the GEMM rate (said in the report).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

# text tokens of the cross-attention context: Wan's T5 (text_len 512, comfy/ldm/wan/model.py); LTX-2.3's Gemma
# connector (1024 tokens, assumed: the prompt's padded length)
TEXT_TOKENS = {"wan22-5b": 512, "wan-14b": 512, "ltx23-22b": 1024, "z-image-turbo": 0}
# Z-Image Turbo has no cross-attention (its 128 assumed text tokens are in plan's token count): 0 text tokens; the
# block arithmetic above still counts two cross projections over the image tokens (2 N C^2) and a two-matrix FFN
# where Z-Image's SwiGLU has three (N C F more): at C 3840, F 10240 that counts 6 C^2 + 2 C F = 167 MFLOP a
# token for 4 C^2 + 3 C F = 177 real, 6 % under


@dataclass(frozen=True)
class Stage:
    name: str
    steps: int
    cfg_batch: int       # batch items per step: 2 with CFG (cond + uncond), 1 without (cfg 1.0)
    scale: float         # width and height of this stage over the requested size


# from the bundled workflows: workflows/Wan 2.2 5B *.json (KSampler 20 steps, cfg 5), workflows/LTX-2.3 *.json
# (LTXVScheduler 20 steps with CFGGuider 4 at half size, LTXVLatentUpsampler, ManualSigmas of 4 sigmas = 3 steps
# with CFGGuider 1); Wan 14B has no bundled workflow: Wan's own default of 20 steps with CFG
STAGES: Dict[str, Tuple[Stage, ...]] = {
    "wan22-5b": (Stage("sampling", 20, 2, 1.0),),
    "wan-14b": (Stage("sampling", 20, 2, 1.0),),
    "ltx23-22b": (Stage("stage 1 (half size)", 20, 2, 0.5), Stage("stage 2 (full size)", 3, 1, 1.0)),
    "z-image-turbo": (Stage("sampling", 8, 1, 1.0),),  # workflows/Z-Image Turbo *.json: KSampler 8 steps, cfg 1
}
METHODS = {"pack": "this pack (auto)", "subquad": "ComfyUI sub-quadratic"}
CALIBRATE_CMD = "python -m attention_core.calibrate"


def layer_flops(spec, n: int, text: Optional[int] = None) -> Dict[str, float]:
    """FLOPs of one block for one batch item, by part (see the module doc)."""
    c, f = spec.width, spec.ffn
    text = TEXT_TOKENS.get(spec.key, 512) if text is None else text
    return {
        "self_proj": 4 * 2.0 * n * c * c,
        "cross_proj": 2 * 2.0 * n * c * c + 2 * 2.0 * text * c * c,
        "ffn": 2 * 2.0 * n * c * f,
        "self_attn": 2 * 2.0 * n * n * c,
        "cross_attn": 2 * 2.0 * n * text * c,
    }


def _interp(rows: List[dict], n: float) -> float:
    """Rate (GFLOP/s) at n tokens: log-log between the measured token counts (r = r0^(1-t) r1^t with
    t = log(n/n0) / log(n1/n0), exactly a measured rate at its token count), flat outside them; a token count
    measured more than once counts with the median of its rates."""
    by_tokens: Dict[float, List[float]] = {}
    for r in rows:
        by_tokens.setdefault(r["tokens"], []).append(r["gflops"])
    pts = sorted((n_, statistics.median(rs)) for n_, rs in by_tokens.items())
    if n <= pts[0][0]:
        return pts[0][1]
    if n >= pts[-1][0]:
        return pts[-1][1]
    for (n0, r0), (n1, r1) in zip(pts, pts[1:]):
        if n0 <= n <= n1:
            t = (math.log(n) - math.log(n0)) / (math.log(n1) - math.log(n0))
            return r0 ** (1.0 - t) * r1 ** t
    return pts[-1][1]


def layer_gemms(spec, n: int, text: Optional[int] = None) -> List[Tuple[str, int, int, int, int]]:
    """The linear layers of one block: (part of layer_flops, rows per batch item, k input width, n output
    width, how many); their FLOPs, 2 * rows * k * n each, add up to layer_flops' projections and FFN."""
    c, f = spec.width, spec.ffn
    text = TEXT_TOKENS.get(spec.key, 512) if text is None else text
    return [("self_proj", n, c, c, 4), ("cross_proj", n, c, c, 2), ("cross_proj", text, c, c, 2),
            ("ffn", n, c, f, 1), ("ffn", n, f, c, 1)]


def layer_elementwise(spec, n: int, text: Optional[int] = None) -> Dict[str, float]:
    """Elements read plus written by one block's memory-bound passes for one batch item, by part (module doc)."""
    c, f = spec.width, spec.ffn
    text = TEXT_TOKENS.get(spec.key, 512) if text is None else text
    return {
        "norms": 6 * 2.0 * n * c + 2.0 * text * c,
        "modulation": 2 * 2.0 * n * c + 3 * 3.0 * n * c,
        "rope": 2 * 5.0 * n * c,
        "layout": 4 * 2.0 * n * c + 2 * 2.0 * n * c + 2 * 2.0 * text * c,
        "activation": 2.0 * n * f,
    }


ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}  # of the calibration's dtype (the activations' dtype)
# A calibration made before the elementwise rate was measured: assume the device streams one byte per 25 FLOPs
# of its GEMM rate (machine balance: a 2-core AVX-512 Xeon, ~270 GFLOP/s fp32 over ~10 GB/s, 27; an MI50,
# 26.5 TFLOP/s fp16 over 1 TB/s, 26; newer GPUs have more FLOPs per byte, so there this overstates the time of
# passes that are a few per cent of a step).
DEFAULT_FLOPS_PER_BYTE = 25.0


def _log_gap(a, b) -> float:
    """|log(a / b)|; 0 when a is absent (an entry without that size matches any)."""
    return 0.0 if a is None else abs(math.log(a / b))


def _gemm_rate(calib: dict, out_width: int, rows: Optional[float] = None, k: Optional[int] = None) -> float:
    """The measured GEMM rate (GFLOP/s) for a layer of `rows` x `k` -> `out_width`: among the entries of the
    nearest measured shape (k and n by ratio; the transposed shape n x k counts as near as the shape itself,
    just behind it), log-log interpolated over their row counts m (flat outside; without `rows`, or an entry
    without m, their median)."""
    def gap(r):
        own = _log_gap(r.get("n"), out_width) + (0.0 if k is None else _log_gap(r.get("k"), k))
        if k is None or r.get("k") is None or r.get("n") is None:
            return own
        return min(own, abs(math.log(r["n"] / k)) + abs(math.log(r["k"] / out_width)) + 1e-9)
    gaps = [(gap(r), r) for r in calib["gemm"]]
    nearest = min(g for g, _ in gaps)
    family = [r for g, r in gaps if g <= nearest + 1e-12]
    if rows is None or any(r.get("m") is None for r in family):
        return statistics.median(r["gflops"] for r in family)
    return _interp([{"tokens": r["m"], "gflops": r["gflops"]} for r in family], rows)


def elementwise_rate(calib: dict, width: int) -> Tuple[float, bool]:
    """(GB/s of memory-bound passes, measured): the median of the calibration's elementwise measurements, else
    the GEMM rate of width x width layers over DEFAULT_FLOPS_PER_BYTE (False: assumed)."""
    rows = calib.get("elementwise")
    if rows:
        return statistics.median(r["gbps"] for r in rows), True
    return _gemm_rate(calib, width, None, width) / DEFAULT_FLOPS_PER_BYTE, False


def model_blocks(spec, blocks: Optional[int] = None) -> int:
    """The blocks a step runs: `blocks` (1 to the model's layers), default all of them; ValueError otherwise."""
    if blocks is None:
        return spec.layers
    if isinstance(blocks, bool) or not isinstance(blocks, int) or not 1 <= blocks <= spec.layers:
        raise ValueError(f"blocks: {spec.title} has {spec.layers} blocks; give a whole number from 1 to "
                         f"{spec.layers}, got {blocks!r}")
    return blocks


def step_time(spec, n: int, calib: dict, method: str, batch: int = 2,
              blocks: Optional[int] = None) -> Optional[Dict[str, float]]:
    """Seconds of one sampling step: {"attention", "gemm", "elementwise", "rest" (GEMMs + elementwise), "total",
    "block" (total over the blocks run)}; None when the calibration has no rates for `method` ("pack" or
    "subquad"). blocks: how many DiT blocks run (default: all of the model's layers)."""
    rows = calib["attention"].get(method)
    if not rows:
        return None
    layers = model_blocks(spec, blocks)
    text = TEXT_TOKENS.get(spec.key, 512)
    fl = layer_flops(spec, n, text)
    att_rate = _interp(rows, n) * 1e9
    cross_rate = _interp(rows, min(n, text)) * 1e9
    attention = layers * batch * (fl["self_attn"] / att_rate + fl["cross_attn"] / cross_rate)
    gemm = layers * batch * sum(count * 2.0 * m * k * o / (_gemm_rate(calib, o, batch * m, k) * 1e9)
                                for _, m, k, o, count in layer_gemms(spec, n, text))
    gbps = elementwise_rate(calib, spec.width)[0]
    elem = ELEMENT_BYTES.get(calib.get("dtype"), 4)
    elementwise = layers * batch * sum(layer_elementwise(spec, n, text).values()) * elem / (gbps * 1e9)
    total = attention + gemm + elementwise
    return {"attention": attention, "gemm": gemm, "elementwise": elementwise, "rest": gemm + elementwise,
            "total": total, "block": total / layers}


def run_time(spec, width: int, height: int, frames: int, calib: dict, tokens: Callable,
             steps: Optional[List[int]] = None, batch: int = 1, blocks: Optional[int] = None) -> dict:
    """Per stage: tokens, steps, seconds per step and for the stage, per method; and the run's totals.
    tokens(spec, width, height, frames): the video tokens of a size (attention_core.plan.tokens); blocks: the
    blocks a step runs (model_blocks)."""
    model = spec.key
    stages = STAGES[model]
    if steps is not None and len(steps) != len(stages):
        raise ValueError(f"--steps: {model} runs {len(stages)} stage(s) ({', '.join(s.name for s in stages)}); "
                         f"give {len(stages)} comma-separated step count(s), got {len(steps)}")
    layers = model_blocks(spec, blocks)
    out, totals = [], {m: 0.0 for m in METHODS}
    for i, st in enumerate(stages):
        w, h = max(1, int(width * st.scale)), max(1, int(height * st.scale))
        n = tokens(spec, w, h, frames)
        k = st.steps if steps is None else steps[i]
        per = {m: step_time(spec, n, calib, m, st.cfg_batch * batch, layers) for m in METHODS}
        for m, t in per.items():
            if t is None:
                totals[m] = None
            elif totals[m] is not None:
                totals[m] += k * t["total"]
        out.append({"stage": st, "width": w, "height": h, "tokens": n, "steps": k, "per_step": per})
    return {"stages": out, "totals": totals, "blocks": layers}


def _dur(s: float) -> str:
    if s < 120:
        return f"{s:,.1f} s"
    if s < 7200:
        return f"{s / 60:,.1f} min"
    return f"{s / 3600:,.2f} h"


def _blocks(n: int) -> str:
    return f"{n} block{'' if n == 1 else 's'}"


def _gbps(x: float) -> str:
    """12.3, 1,234.5; below 1 GB/s two significant digits (0.04)."""
    return f"{x:,.1f}" if x >= 1 else f"{x:.2g}"


def report(spec, width: int, height: int, frames: int, calib: Optional[dict], where: str = "",
           steps: Optional[List[int]] = None, batch: int = 1, tokens: Optional[Callable] = None,
           blocks: Optional[int] = None) -> str:
    """The time section of the plan: per stage and method, seconds per step and per block (attention, GEMMs,
    elementwise) and for the stage, and the run; without a calibration, the command that makes one."""
    if calib is None:
        cmd = CALIBRATE_CMD + (f" --out {where}" if where else "")
        return (f"  time per step: no calibration of this device{(' at ' + where) if where else ''}, so no estimate; "
                f"run `{cmd}` (about a minute) and ask again")
    rt = run_time(spec, width, height, frames, calib, tokens, steps, batch, blocks)
    gbps, measured = elementwise_rate(calib, spec.width)
    depth = (f"all {_blocks(spec.layers)} a step" if rt["blocks"] == spec.layers else
             f"{rt['blocks']} of its {_blocks(spec.layers)} a step")
    lines = [f"  time (calibration of {calib['device']}, {calib['dtype']}, {calib['date']}; {depth}):",
             f"    counted: GEMMs at the rates measured nearest each layer's shape, attention, and elementwise passes "
             f"(norms, modulation, RoPE, residual adds, layout copies, GELU) at {_gbps(gbps)} GB/s "
             + ("(measured)" if measured else f"(assumed: this calibration has no elementwise rate; {CALIBRATE_CMD} "
                                              "measures one)")]
    for s in rt["stages"]:
        st = s["stage"]
        lines.append(f"    {st.name}: {s['width']}x{s['height']}, {s['tokens']:,} tokens, {s['steps']} steps, batch "
                     f"{st.cfg_batch * batch}{' (CFG)' if st.cfg_batch == 2 else ''}")
        for m, label in METHODS.items():
            t = s["per_step"][m]
            if t is None:
                lines.append(f"      {label:<24} not calibrated (ComfyUI was not found by {CALIBRATE_CMD})")
            else:
                lines.append(f"      {label:<24} {_dur(t['total'])} a step, {_dur(t['block'])} a block (attention "
                             f"{_dur(t['attention'])}, GEMMs {_dur(t['gemm'])}, elementwise "
                             f"{_dur(t['elementwise'])}); {_dur(s['steps'] * t['total'])} for the stage")
    for m, label in METHODS.items():
        if rt["totals"][m] is not None:
            lines.append(f"    whole run, {label:<24} {_dur(rt['totals'][m])}")
    return "\n".join(lines)

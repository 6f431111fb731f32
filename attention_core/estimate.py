"""How long a step and a run take, from a model spec (attention_core.plan's ModelSpec, passed in) and a device
calibration (attention_core.calibrate). Pure arithmetic: no torch import, nothing measured, no attention_core
import (attention_core.plan shows these numbers, so this module must not import it).

FLOPs of one DiT block for one batch item (N video tokens, width C = heads x head_dim, FFN width F, L text
tokens), counting the GEMMs only (norms, modulation, RoPE and the GELU are elementwise, O(N*C)):
  self-attention projections  q, k, v, out: 4 * 2*N*C*C
  cross-attention projections q, out over the video tokens: 2 * 2*N*C*C; k, v over the text: 2 * 2*L*C*C
  self-attention core         Q K^T and P V: 2 * 2*N*N*C
  cross-attention core        2 * 2*N*L*C
  feed-forward                up and down: 2 * 2*N*C*F
A step runs every block for each batch item (2 with CFG: the conditional and unconditional passes); a run is the
steps of each stage (LTX-2.3: 20 CFG steps at half size, then 3 steps at full size without CFG). Times are FLOPs
over the calibration's measured rates: GEMMs at the rate of the same shape, attention at the rate measured for
that method at the nearest token counts (log-log interpolation, the largest measured beyond the last).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

# text tokens of the cross-attention context: Wan's T5 (text_len 512, comfy/ldm/wan/model.py); LTX-2.3's Gemma
# connector (1024 tokens, assumed: the prompt's padded length)
TEXT_TOKENS = {"wan22-5b": 512, "wan-14b": 512, "ltx23-22b": 1024}


@dataclass(frozen=True)
class Stage:
    name: str
    steps: int
    cfg_batch: int       # batch items per step: 2 with CFG (cond + uncond), 1 without (cfg 1.0)
    scale: float         # width and height of this stage over the requested size


# from the bundled workflows: workflows/wan22_5b_*.json (KSampler 20 steps, cfg 5), workflows/ltx23_22b_*.json
# (LTXVScheduler 20 steps with CFGGuider 4 at half size, LTXVLatentUpsampler, ManualSigmas of 4 sigmas = 3 steps
# with CFGGuider 1); Wan 14B has no bundled workflow: Wan's own default of 20 steps with CFG
STAGES: Dict[str, Tuple[Stage, ...]] = {
    "wan22-5b": (Stage("sampling", 20, 2, 1.0),),
    "wan-14b": (Stage("sampling", 20, 2, 1.0),),
    "ltx23-22b": (Stage("stage 1 (half size)", 20, 2, 0.5), Stage("stage 2 (full size)", 3, 1, 1.0)),
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


def _gemm_rate(calib: dict, out_width: int) -> float:
    """The measured GEMM rate of the shape nearest to out_width output columns."""
    return min(calib["gemm"], key=lambda r: abs(math.log(r.get("n", out_width) / out_width)))["gflops"]


def step_time(spec, n: int, calib: dict, method: str, batch: int = 2,
              blocks: Optional[int] = None) -> Optional[Dict[str, float]]:
    """Seconds of one sampling step: {"attention", "rest", "total"}; None when the calibration has no rates for
    `method` ("pack" or "subquad"). blocks: how many DiT blocks run (default: all of the model's layers)."""
    rows = calib["attention"].get(method)
    if not rows:
        return None
    fl = layer_flops(spec, n)
    layers = spec.layers if blocks is None else blocks
    att_rate = _interp(rows, n) * 1e9
    cross_rate = _interp(rows, min(n, TEXT_TOKENS.get(spec.key, 512))) * 1e9
    proj_rate = _gemm_rate(calib, spec.width) * 1e9
    ffn_rate = _gemm_rate(calib, spec.ffn) * 1e9
    attention = layers * batch * (fl["self_attn"] / att_rate + fl["cross_attn"] / cross_rate)
    rest = layers * batch * ((fl["self_proj"] + fl["cross_proj"]) / proj_rate + fl["ffn"] / ffn_rate)
    return {"attention": attention, "rest": rest, "total": attention + rest}


def run_time(spec, width: int, height: int, frames: int, calib: dict, tokens: Callable,
             steps: Optional[List[int]] = None, batch: int = 1) -> dict:
    """Per stage: tokens, steps, seconds per step and for the stage, per method; and the run's totals.
    tokens(spec, width, height, frames): the video tokens of a size (attention_core.plan.tokens)."""
    model = spec.key
    stages = STAGES[model]
    if steps is not None and len(steps) != len(stages):
        raise ValueError(f"--steps: {model} runs {len(stages)} stage(s) ({', '.join(s.name for s in stages)}); "
                         f"give {len(stages)} comma-separated step count(s), got {len(steps)}")
    out, totals = [], {m: 0.0 for m in METHODS}
    for i, st in enumerate(stages):
        w, h = max(1, int(width * st.scale)), max(1, int(height * st.scale))
        n = tokens(spec, w, h, frames)
        k = st.steps if steps is None else steps[i]
        per = {m: step_time(spec, n, calib, m, st.cfg_batch * batch) for m in METHODS}
        for m, t in per.items():
            if t is None:
                totals[m] = None
            elif totals[m] is not None:
                totals[m] += k * t["total"]
        out.append({"stage": st, "width": w, "height": h, "tokens": n, "steps": k, "per_step": per})
    return {"stages": out, "totals": totals}


def _dur(s: float) -> str:
    if s < 120:
        return f"{s:,.1f} s"
    if s < 7200:
        return f"{s / 60:,.1f} min"
    return f"{s / 3600:,.2f} h"


def report(spec, width: int, height: int, frames: int, calib: Optional[dict], where: str = "",
           steps: Optional[List[int]] = None, batch: int = 1, tokens: Optional[Callable] = None) -> str:
    """The time section of the plan: per stage and method, seconds per step (attention / the rest) and the run;
    without a calibration, the command that makes one."""
    if calib is None:
        cmd = CALIBRATE_CMD + (f" --out {where}" if where else "")
        return (f"  time per step: no calibration of this device{(' at ' + where) if where else ''}, so no estimate; "
                f"run `{cmd}` (under a minute) and ask again")
    rt = run_time(spec, width, height, frames, calib, tokens, steps, batch)
    lines = [f"  time (calibration of {calib['device']}, {calib['dtype']}, {calib['date']}; GEMMs and attention "
             f"only, elementwise ops not counted):"]
    for s in rt["stages"]:
        st = s["stage"]
        lines.append(f"    {st.name}: {s['width']}x{s['height']}, {s['tokens']:,} tokens, {s['steps']} steps, batch "
                     f"{st.cfg_batch * batch}{' (CFG)' if st.cfg_batch == 2 else ''}")
        for m, label in METHODS.items():
            t = s["per_step"][m]
            if t is None:
                lines.append(f"      {label:<24} not calibrated (ComfyUI was not found by {CALIBRATE_CMD})")
            else:
                lines.append(f"      {label:<24} {_dur(t['total'])} a step (attention {_dur(t['attention'])}, "
                             f"the rest {_dur(t['rest'])}); {_dur(s['steps'] * t['total'])} for the stage")
    for m, label in METHODS.items():
        if rt["totals"][m] is not None:
            lines.append(f"    whole run, {label:<24} {_dur(rt['totals'][m])}")
    return "\n".join(lines)

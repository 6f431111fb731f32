"""Predicted vs measured seconds per sampling step: attention_core.estimate against real-width Wan 2.2 5B blocks.

    python -m tools.measure.predict_step [--blocks 2] [--tokens 4290] [--calibration FILE] [--device cpu] [--log FILE]

Builds `--blocks` real-width Wan 2.2 TI2V 5B DiT blocks in plain torch (width 3072 = 24 heads x 128, FFN 14336,
the block layout of comfy/ldm/wan/model.py: modulated LayerNorm, self-attention with RMS-normed q/k, cross-attention
over 512 text tokens, GELU feed-forward; random weights, no RoPE) and runs one step's forward (batch 2: CFG) with
each attention: this pack's (attention_core, tier auto, q/k/v in ComfyUI's layout as the node hands them) and
ComfyUI's sub-quadratic (comfy.ldm.modules.attention.attention_sub_quad). The time of the first k blocks is the
step time of a k-block model (the demo's `--blocks k`, without its embedding and head). The prediction comes from a
calibration made in the same process just before (or `--calibration FILE`), so both see the same machine load.
Each measured figure names the load it ran at (other processes' runnable threads, "others": attention_core.
machine_load); --log is not written when other processes kept the machine busy (on average more than a quarter of
the cores) unless --force-busy, and the logged table then says so.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from attention_core.cli import calibrate, cli_args, estimate, plan
from attention_core.device import calibration, machine_load
from attention_core.device.sync import synchronize


class WanBlock(torch.nn.Module):
    """One Wan 2.2 5B DiT block at real width (comfy/ldm/wan/model.py WanAttentionBlock, t2v cross-attention)."""

    def __init__(self, dim=3072, ffn=14336, heads=24):
        super().__init__()
        self.heads = heads
        lin = torch.nn.Linear
        self.q, self.k, self.v, self.o = (lin(dim, dim) for _ in range(4))
        self.cq, self.ck, self.cv, self.co = (lin(dim, dim) for _ in range(4))
        self.nq, self.nk, self.cnq, self.cnk = (torch.nn.RMSNorm(dim, eps=1e-6) for _ in range(4))
        self.norm1, self.norm2 = (torch.nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6) for _ in range(2))
        self.norm3 = torch.nn.LayerNorm(dim, eps=1e-6)
        self.ffn1, self.ffn2 = lin(dim, ffn), lin(ffn, dim)
        self.modulation = torch.nn.Parameter(torch.randn(1, 6, dim) / dim ** 0.5)
        for m in self.modules():
            if isinstance(m, torch.nn.Linear):
                torch.nn.init.normal_(m.weight, std=m.in_features ** -0.5)

    def forward(self, x, context, e, attention):
        e = (self.modulation + e).chunk(6, dim=1)
        y = self.norm1(x) * (1 + e[1]) + e[0]
        y = attention(self.nq(self.q(y)), self.nk(self.k(y)), self.v(y), self.heads)
        x = x + self.o(y) * e[2]
        y = self.norm3(x)
        y = attention(self.cnq(self.cq(y)), self.cnk(self.ck(context)), self.cv(context), self.heads)
        x = x + self.co(y)
        y = self.norm2(x) * (1 + e[4]) + e[3]
        return x + self.ffn2(F.gelu(self.ffn1(y), approximate="tanh")) * e[5]


def pack_attention(q, k, v, heads):
    """As nodes/comfy_adapter.py runs the engine: [B, N, H*D] viewed as heads, output back to [B, N, H*D]."""
    from attention_core.sdpa import scaled_dot_product_attention
    b, n, c = q.shape
    d = c // heads
    q, k, v = (t.reshape(b, -1, heads, d).transpose(1, 2) for t in (q, k, v))
    return scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c)


def block_inputs(batch, tokens, text, width, device):
    """Seeded (x, context, e) of a block forward: `tokens` video rows, `text` text rows, the 6 modulation rows."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, tokens, width, generator=g).to(device)
    ctx = torch.randn(batch, text, width, generator=g).to(device)
    e = torch.randn(batch, 6, width, generator=g).to(device) * 0.1
    return x, ctx, e


def measure(blocks, tokens, attention, device, text=512, batch=2, monitor=None, name=None):
    """Seconds of each block's forward (one step of a `batch`-item CFG pass); with a machine_load.Monitor, each
    block runs in its span (name, block index)."""
    x, ctx, e = block_inputs(batch, tokens, text, 3072, device)
    times = []
    with torch.no_grad():
        for i, blk in enumerate(blocks):
            with monitor.span((name, i)) if monitor is not None else contextlib.nullcontext():
                t0 = time.perf_counter()
                x = blk(x, ctx, e, attention)
                synchronize(device)
                times.append(time.perf_counter() - t0)
    return times


def block_medians(block, tokens, attentions: dict, device, rounds=3, batch=1, text=512, monitor=None) -> dict:
    """{method: median seconds of one `block` forward} with each attention of `attentions` {method: fn}, after a
    warm-up each, in `rounds` interleaved rounds (pack, subquad, pack, ...): every method sees the same machine
    load, as in attention_core.calibrate.interleaved. With a machine_load.Monitor each call runs in its span
    (method, "block")."""
    from attention_core.cli.calibrate import interleaved
    x, ctx, e = block_inputs(batch, tokens, text, block.norm1.normalized_shape[0], device)
    sync = functools.partial(synchronize, device)

    def run(fn):
        def call():
            block(x, ctx, e, fn)
            sync()
        return call
    with torch.no_grad():
        seconds = interleaved(monitor, {(m, "block"): run(fn) for m, fn in attentions.items()}, rounds)
    return {m: seconds[(m, "block")] for m in attentions}


def main(argv=None) -> int:
    ap = cli_args.Parser(prog="python -m tools.measure.predict_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=cli_args.int_range(1, 30), default=2, help="DiT blocks run (Wan 5B has 30)")
    ap.add_argument("--tokens", type=cli_args.int_range(1, 200_000), default=4290,
                    help="video tokens (4,290: Wan 2.2 5B at 832x480, 41 frames)")
    ap.add_argument("--calibration", type=cli_args.existing_file, default=None,
                    help="calibration file (default: calibrate now, not saved)")
    ap.add_argument("--device", type=cli_args.device, default="cpu", help="cpu, cuda, cuda:1")
    ap.add_argument("--batch", type=cli_args.int_range(1, 64), default=2,
                    help="batch items a step (2: CFG; 1: one half, on a busy CPU)")
    ap.add_argument("--methods", type=cli_args.choice_list(estimate.METHODS, "methods"), default="pack,subquad",
                    help="comma-separated: " + ", ".join(estimate.METHODS))
    ap.add_argument("--repeats", type=cli_args.int_range(1, 100), default=2,
                    help="calibration runs per shape after a warm-up (best kept)")
    ap.add_argument("--log", type=cli_args.output_file, default=None, help="append the table (markdown) to this file")
    ap.add_argument(machine_load.FORCE_FLAG, action="store_true",
                    help="append to --log even when other processes kept the machine busy while it measured (their "
                         "runnable threads above a quarter of the cores on average); the table says so")
    a = ap.parse_args(argv)
    methods = a.methods.split(",")
    from attention_core.cli.bench import default_comfyui
    from attention_core.cli.bench_methods import comfy_attention
    comfyui = default_comfyui()
    if "subquad" in methods and not comfyui:
        cli_args.fail(ap, "--methods", "subquad needs ComfyUI: set COMFYUI_PATH (or run ./dev setup)")
    device = torch.device(a.device)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    monitor = machine_load.Monitor(force=a.force_busy)
    if a.calibration:
        calib = calibration.load(a.calibration)
        if calib is None:
            cli_args.fail(ap, "--calibration", f"{a.calibration!r} is not a valid calibration file (make one with "
                          "python -m attention_core.calibrate)")
    with monitor:
        if not a.calibration:
            calib = calibrate.measure(a.device, "fp32", "wan22-5b",
                                      comfyui=comfyui if "subquad" in methods else None, repeats=a.repeats,
                                      monitor=monitor)
        cal_s = time.perf_counter() - t0
        torch.manual_seed(0)
        blocks = [WanBlock().to(device) for _ in range(a.blocks)]
        attn = {"pack": pack_attention}
        if "subquad" in methods:
            attn["subquad"] = comfy_attention(comfyui, "comfy-subquad")
        spec = plan.MODELS["wan22-5b"]
        rows = []
        measured = {m: measure(blocks, a.tokens, attn[m], device, batch=a.batch, monitor=monitor, name=m)
                    for m in methods}
    load1 = os.getloadavg()
    load = monitor.summary()
    for k in range(1, a.blocks + 1):
        for m in methods:
            pred = estimate.step_time(spec, a.tokens, calib, m, batch=a.batch, blocks=k)
            meas = sum(measured[m][:k])
            spans = [monitor.figures[(m, i)] for i in range(k)]
            readings = [x for sp in spans for x in sp.samples if x is not None]
            others = machine_load.figure_text(sum(readings) / len(readings) if readings else None,
                                              max(readings) if readings else None)
            rows.append((k, m, pred["total"], pred["attention"], meas, pred["total"] / meas - 1, others))
    head = (f"real-width Wan 2.2 5B blocks, {a.tokens:,} tokens, batch {a.batch}{' (CFG)' if a.batch == 2 else ''}, fp32, {calib['device']}, torch "
            f"{torch.__version__}, {torch.get_num_threads()} threads, "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; calibration {calib['date']} "
            f"({cal_s:.0f} s); load average {load0[0]:.1f} before, {load1[0]:.1f} after; measured at: "
            f"{machine_load.describe(load)}"
            + ("; MACHINE BUSY, logged anyway (--force-busy)" if load["forced"] else ""))
    lines = [head, "", "| blocks | attention | predicted s/step (attention) | measured s/step | predicted / measured "
             "- 1 | other processes' runnable threads |", "|---|---|---|---|---|---|"]
    for k, m, p, pa, me, err, others in rows:
        lines.append(f"| {k} | {estimate.METHODS[m]} | {p:.1f} ({pa:.1f}) | {me:.1f} | {err:+.0%} | {others} |")
    text = "\n".join(lines)
    print(text)
    refused = machine_load.refusal(load, f"--log {a.log}") if a.log else None
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        return 2
    if a.log:
        with open(a.log, "a") as f:
            f.write(text + "\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

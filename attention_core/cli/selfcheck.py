"""Self-check on your device: every tier against torch's math SDPA in float64, in the dtypes your GPU runs.

    python -m attention_core.selfcheck                 # the current accelerator (else the CPU)
    python -m attention_core.selfcheck --device cuda:1

Prints the detection report, then one line per case (tier, dtype, shape, max error, tolerance) and exits
non-zero if any case is off. Run it after installing a new ROCm / PyTorch build.
"""
from __future__ import annotations

import sys

import torch

from . import cli_args
from ..device.detection import detect
from ..device.torch_sdpa import math_sdpa
from ..sdpa import scaled_dot_product_attention
from ..kernel.tiers import ORDER as TIERS

TOLERANCE = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}


def _reference(q, k, v, **kw):
    """torch's own math SDPA in float64 on the CPU: the builtin, so that a process where the global patch or the
    process-wide mode is on (torch.nn.functional's attribute is the engine there) still checks the engine against
    torch, never against itself."""
    return math_sdpa(q.double().cpu(), k.double().cpu(), v.double().cpu(), **kw)


def cases(device: torch.device):
    """(name, dtype, q, k, v, kwargs): plain, causal, masked, GQA, and a fp16 overflow case."""
    g = torch.Generator().manual_seed(0)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    dtypes = [torch.float32] + ([torch.float16, torch.bfloat16] if device.type != "cpu" else [])
    for dt in dtypes:
        q, k, v = r(2, 8, 300, 64), r(2, 8, 260, 64), r(2, 8, 260, 64)
        yield "plain", dt, q, k, v, {}
        yield "causal", dt, q, k, v, {"is_causal": True}
        mask = torch.rand(2, 1, 1, 260, generator=g) > 0.2
        yield "key-padding mask", dt, q, k, v, {"attn_mask": mask}
        yield "gqa 8/2", dt, q, k[:, :2], v[:, :2], {"enable_gqa": True}
    if device.type != "cpu":
        q, k = r(1, 4, 64, 64, scale=40), r(1, 4, 80, 64, scale=40)
        yield "fp16 overflowing scores", torch.float16, q, k, r(1, 4, 80, 64), {}


def skipped(device: torch.device) -> list:
    """[(what, why)]: the cases `cases` leaves out on this device, said in the output so no one mistakes them for
    checked."""
    if device.type != "cpu":
        return []
    return [("float16 and bfloat16 cases", "half-precision attention is checked on GPUs; on the CPU torch runs "
             "half matmuls through other kernels than a GPU's, so they would say nothing about your GPU"),
            ("fp16 overflowing scores", "needs a GPU's fp16 arithmetic")]


def run(device=None, verbose=True) -> bool:
    dev = torch.device(device) if device else (torch.device("cuda") if torch.cuda.is_available()
                                              else torch.device("cpu"))
    report = detect(dev)
    if verbose:
        print(report.text(), flush=True)
        print()
    ok = True
    for name, dt, q, k, v, kw in cases(dev):
        kw = dict(kw)
        mask = kw.pop("attn_mask", None)
        qd, kd, vd = (t.to(dev, dt) for t in (q, k, v))
        ref = _reference(qd, kd, vd, attn_mask=mask, **kw)
        for tier in TIERS:
            out = scaled_dot_product_attention(qd, kd, vd, None if mask is None else mask.to(dev), tier=tier,
                                               precision="input", block_q=64, block_kv=128, **kw)
            err = float((out.double().cpu() - ref).abs().max()) if torch.isfinite(out).all() else float("inf")
            tol = TOLERANCE[dt] * max(1.0, float(ref.abs().max()))
            good = err <= tol and out.dtype == dt
            ok &= good
            if verbose:
                print(f"{'ok ' if good else 'BAD'} {tier:<8} {str(dt).replace('torch.', ''):<9} {name:<24} "
                      f"q{tuple(q.shape)} max err {err:.2e} (tolerance {tol:.1e})", flush=True)
    if verbose:
        for what, why in skipped(dev):
            print(f"skipped {what}: {why}", flush=True)
        print("\nall cases within tolerance" if ok else "\nSOME CASES FAILED: please report them with the output "
                                                       "above")
    return ok


def main(argv=None):
    ap = cli_args.Parser(prog="python -m attention_core.selfcheck", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", type=cli_args.device, default=None,
                    help="cpu, cuda, cuda:1 (default: the accelerator if any)")
    a = ap.parse_args(argv)
    return 0 if run(a.device) else 1


if __name__ == "__main__":
    sys.exit(main())

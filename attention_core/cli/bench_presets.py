"""The cases a benchmark run measures: (mode, N, heads, head dim, dtype, preset) from --preset (real models'
attention shapes: attention_core.plan's PRESETS) or from the explicit --n / --heads / --dim / --bwd-n options
(build_plan), and the check, before anything runs, that each case's inputs fit the device (check_inputs_fit).
"""
from __future__ import annotations

from .plan import preset_shapes

GIB = 1 << 30


def build_plan(a):
    """[(mode, N, heads, head dim, dtype, preset)] from --preset or the explicit --n/--heads/--dim options."""
    dtypes = [d.strip() for d in a.dtype.split(",")]
    shapes = []
    if a.preset:
        for name in a.preset.split(","):
            shapes += [(name.strip(), n, a.heads or h, d) for n, h, d in preset_shapes(name.strip())]
        plan = [("fwd" if a.mode != "fwdbwd" else "fwdbwd", n, h, d, dt, name) for name, n, h, d in shapes
                for dt in dtypes]
        return plan
    plan = []
    if a.mode in ("fwd", "both"):
        plan += [("fwd", int(n), a.heads or 16, a.dim, dt, "") for dt in dtypes for n in a.n.split(",")]
    if a.mode in ("fwdbwd", "both"):
        plan += [("fwdbwd", int(n), a.bwd_heads, a.dim, dt, "") for dt in dtypes for n in a.bwd_n.split(",")]
    return plan


def check_inputs_fit(ap, a, device):
    """Exit with one `error:` line naming the flags to change when a case's inputs alone (q, k, v and the output
    gradient) cannot exist in the memory free on `device`."""
    import torch
    from . import cli_args
    from ..kernel.memory import free_memory
    for mode, n, heads, dim, dtype, _ in build_plan(a):  # inputs that cannot exist: say so before running
        need = 4 * a.batch * heads * n * dim * getattr(torch, dtype).itemsize  # q, k, v and the output gradient
        free = free_memory(torch.device(device))
        if free is not None and need > free:
            flag = ("--preset/--heads/--batch" if a.preset else "--bwd-n/--bwd-heads/--dim/--batch" if mode == "fwdbwd"
                    else "--n/--heads/--dim/--batch")
            cli_args.fail(ap, flag, f"N={n} x {heads} heads x {dim} dims x batch {a.batch} in {dtype}: the inputs "
                                    f"alone take {need / GIB:,.1f} GB, {free / GIB:,.1f} GB free on {device}; "
                                    "choose a smaller shape")

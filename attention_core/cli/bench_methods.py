"""The benchmark's methods: their names (METHODS, QUICK_METHODS), what each calls (method_fn: torch's math and
default SDPA, this engine's tiers and variants, the tuned profile, noflash-attention, ComfyUI's sub-quadratic and
split attention) and the transient memory the quadratic ones need (method_bytes, from attention_core.plan's
rules), so that attention_core.bench skips a case that cannot fit instead of running it out of memory.
"""
from __future__ import annotations

import sys

METHODS = ["math", "torch", "chunked", "inplace", "online", "auto", "chunked-prev", "auto-prev", "chunked-queries",
           "chunked-keys", "tuned", "noflash-t1", "noflash-t2",
           "noflash-t3", "comfy-subquad", "comfy-split"]
QUICK_METHODS = ["math", "torch", "chunked", "auto", "tuned", "comfy-subquad"]
PREV_CPU_TARGET = 1 << 21  # the CPU forward tile target before issue 18.5 (chunked-prev, auto-prev)


def method_bytes(method, case, free):
    """Transient bytes `method` needs for `case` (attention_core.plan's rules), or None when it is O(N)."""
    from . import plan
    bh, n = case["batch"] * case["heads"], case["n"]
    e = {"float32": 4, "float64": 8}.get(case["dtype"], 2)
    grad = 2 if case["mode"] == "fwdbwd" else 1
    if method == "math":
        return grad * plan.math_bytes(bh, n, e)
    if method == "comfy-subquad":
        return grad * plan.comfy_subquad(bh, n, e, free)["bytes"]
    if method == "comfy-split":
        sp = plan.comfy_split(bh, n, e, free)
        return sp["bytes"] if sp["bytes"] is not None else float("inf")
    if method == "noflash-t1":
        return 2 * bh * n * n * e // 4  # its tier-1 chunks hold about a quarter of the scores at a time
    return None



def method_fn(name, case, torch):
    """A callable (q, k, v) -> out for `name`, or a string saying why it is unavailable."""
    from attention_core.device.torch_sdpa import math_sdpa, torch_sdpa  # torch's own, even with the patch on
    if name == "math":
        return lambda q, k, v: math_sdpa(q, k, v)
    if name == "torch":
        return lambda q, k, v: torch_sdpa(q, k, v)
    if name in ("chunked", "inplace", "online", "auto"):
        from attention_core import scaled_dot_product_attention
        return lambda q, k, v: scaled_dot_product_attention(q, k, v, tier=name)
    if name in ("chunked-prev", "auto-prev"):
        from attention_core.kernel import memory
        from attention_core import scaled_dot_product_attention
        # this case's own process (see bench_run._run_in_subprocess): the previous CPU defaults, forward and
        # backward tiles aiming at 2^21 scores
        memory.TARGET_TILE_ELEMS = dict(memory.TARGET_TILE_ELEMS, cpu=PREV_CPU_TARGET)
        memory.BACKWARD_TILE_ELEMS = dict(memory.BACKWARD_TILE_ELEMS, cpu=PREV_CPU_TARGET)
        tier = name[: -len("-prev")]
        return lambda q, k, v: scaled_dot_product_attention(q, k, v, tier=tier)
    if name in ("chunked-queries", "chunked-keys"):
        import os

        from attention_core.device import profiles
        from attention_core import scaled_dot_product_attention
        os.environ[profiles.ENV_LAYOUT] = name[len("chunked-"):]  # this case's own process (bench_run)
        return lambda q, k, v: scaled_dot_product_attention(q, k, v, tier="chunked")
    if name == "tuned":
        from ..device import profiles
        from . import tune
        entry = profiles.lookup(q_shape=(case["batch"], case["heads"], case["n"], case["dim"]), dtype=case["dtype"],
                                device=case["device"])
        if entry is None:
            return (f"no tuned profile for this device and dtype ({profiles.profile_path()}): "
                    "python -m attention_core.tune")
        return lambda q, k, v: tune.run_blocks(q, k, v, entry)
    if name.startswith("noflash"):
        try:
            import contextlib
            import io
            with contextlib.redirect_stdout(io.StringIO()):
                import noflash_attention as nf  # it patches torch's SDPA on import where it thinks it should
                nf.disable()
            from noflash_attention import patch as nfp
        except Exception as e:  # noqa: BLE001
            return f"not importable ({e.__class__.__name__}); pip install noflash-attention==1.0.1"
        B, H, N = case["batch"], case["heads"], case["n"]
        dt = getattr(torch, case["dtype"])
        if name == "noflash-t1":  # the block size its dispatcher picks for tier 1
            bm = nfp._auto_block_m(B, N, H, dt, budget_factor=2)
            return lambda q, k, v: nfp.chunked_sdpa(q, k, v, None, bm)
        if name == "noflash-t2":
            bm = nfp._auto_block_m(B, N, H, dt, budget_factor=1)
            bn = nfp._auto_block_n(B, bm, H, dt)
            return lambda q, k, v: nfp.chunked_sdpa_online(q, k, v, None, bm, bn)
        bm = nfp._auto_block_m(B, N, H, dt, budget_factor=1)
        return lambda q, k, v: nfp.chunked_sdpa_inplace(q, k, v, None, bm)
    if name.startswith("comfy"):
        path = case.get("comfyui")
        if not path:
            return "no ComfyUI path (--comfyui or COMFYUI_PATH)"
        try:
            fn = comfy_attention(path, name)
        except Exception as e:  # noqa: BLE001
            return f"ComfyUI import failed: {e}"
        heads = case["heads"]
        return lambda q, k, v: fn(q, k, v, heads, skip_reshape=True, skip_output_reshape=True)
    raise ValueError(f"unknown method {name}")


def comfy_attention(path, name):
    """ComfyUI's sub-quadratic (`name` "comfy-subquad") or split attention function from the ComfyUI at `path`,
    imported without parsing the command line (its CPU mode where there is no GPU)."""
    if path not in sys.path:
        sys.path.insert(0, path)
    import comfy.options
    comfy.options.enable_args_parsing(False)
    import comfy.cli_args
    if comfy.cli_args.args is not None:
        import torch
        if not torch.cuda.is_available():
            comfy.cli_args.args.cpu = True
    from comfy.ldm.modules import attention
    return attention.attention_sub_quad if name == "comfy-subquad" else attention.attention_split


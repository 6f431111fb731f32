"""The exact-attention kernel: what attention_core.scaled_dot_product_attention runs below its entry point.

One import floor per module, every arrow downward (tests/engine/test_engine_layout.py holds it):
    problem    one call in the canonical layout          numerics   tile dtypes, flush-to-zero, dropout bits
    tiles      score tiles                               tiers/     the forward tiers and the recompute backward
    memory     tile sizes from a memory budget           oom        out-of-memory errors, cache release
    driver     plan -> run -> retry smaller -> next tier ops        raw forward / backward (out, log-sum-exp)
    tangents   forward-mode AD                           autocast   torch's autocast rule at the entry
    autograd   the custom ops and their autograd.Function
Below it only attention_core.device (what the pack knows about the device); never the public entry points, the
commands or ComfyUI.
"""

"""attention_core: exact tiled attention in plain PyTorch matmuls, O(N) memory in forward and backward.

Public API (what the README documents; these names and import paths stay importable):
    scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, *, scale, enable_gqa, tier, ...,
                                 return_lse=False)   torch's SDPA (its refusals and its torch.autocast casts);
                                                     a torch custom op (torch.compile, torch.func)
    TIERS, TIER_CHOICES                          the tier names ("auto" + TIERS is what `tier` accepts)
    detect(device=None) -> DeviceReport         does this device need tiled attention?
    enable(), disable(), is_enabled(), patched()  optional global patch of torch's SDPA (never at import)
    chunk_ffn(module, chunks=0), unchunk_ffn, ChunkedFFN   exact token-chunked feed-forward
    AttentionMemoryError                         raised when no tile size fits the memory
  modules:
    attention_core.ops            attention_forward / attention_backward: raw (out, lse) forward and the backward
                                  given O and lse (from attention_core.ops import ...; defined in kernel/ops.py,
                                  also importable from attention_core.kernel.ops)
    attention_core.patch          the global patch (enable, disable, patched, is_enabled, stats)
    attention_core.multidevice    scaled_dot_product_attention_on_devices: heads split over the GPUs of a process
    attention_core.parallel       ulysses_attention, ring_attention, flash_layout_attention: torch.distributed
    attention_core.estimate       step_time: the time-per-step estimate the planner uses (defined in cli/estimate.py)
  commands (python -m attention_core.X): selfcheck, plan, bench, tune, calibrate, report; their code lives in
  attention_core/cli/ (cli/plan.py, ...), and attention_core.X, a one-line alias at the top, is that module
Everything else (attention_core.kernel but its ops' two functions, attention_core.device, the ffn package's modules,
attention_core.cli's modules under their cli/ names) is internal and may move.
Importing this package changes nothing global; under torch < 2.5 it raises torch_version.TorchTooOld (an
ImportError naming the torch needed). __version__ is pyproject.toml's [project] version, the one place it is written,
read when first asked: from the pyproject.toml beside this package (a clone, a ComfyUI custom_nodes folder), else from
the installed distribution's metadata (the wheel, built from that file).
"""
from .device.torch_version import require_torch

require_torch()  # before anything that needs torch >= 2.5: one clear ImportError, not an AttributeError

from .device.detection import DeviceReport, detect
from .ffn import ChunkedFFN, chunk_ffn, unchunk_ffn
from .kernel.memory import AttentionMemoryError
from .patch import disable, enable, is_enabled, patched
from .sdpa import scaled_dot_product_attention
from .kernel.tiers import ORDER as TIERS, TIER_CHOICES
from . import ops  # attention_core.ops.attention_forward, as the README documented it before the ops moved

__all__ = ["scaled_dot_product_attention", "detect", "DeviceReport", "enable", "disable", "is_enabled", "patched",
           "chunk_ffn", "unchunk_ffn", "ChunkedFFN", "AttentionMemoryError", "TIERS", "TIER_CHOICES"]


def __getattr__(name):  # PEP 562: attention_core.__version__ is read when asked, not at import
    if name == "__version__":
        from .version import version
        return version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

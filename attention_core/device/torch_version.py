"""Which torch the engine needs: MIN_TORCH and a check that names it, run first when the package is imported.

torch 2.5 is the oldest with everything the engine is built on: torch.library.custom_op with register_fake and
register_vmap (the ops' vmap rules, torch.func), and enable_gqa in scaled_dot_product_attention (torch's API the
engine mirrors and is tested against). torch 2.4 has neither register_vmap nor enable_gqa.
"""
import re

import torch

MIN_TORCH = (2, 5)


class TorchTooOld(ImportError):
    """Raised on import under a torch older than MIN_TORCH; the ComfyUI entry point logs it as one line."""


def parse(version: str) -> tuple:
    """(major, minor) of a torch version string such as '2.5.1+rocm6.2' or '2.6.0a0+git1234'."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def require_torch(version: str = torch.__version__) -> None:
    """Raise TorchTooOld naming the torch found and the one needed when `version` is older than MIN_TORCH."""
    if parse(version) < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        raise TorchTooOld(f"tiled attention needs torch >= {need} (found {version}): older torch has no "
                          f"torch.library register_vmap and no enable_gqa; install torch {need} or newer (ROCm "
                          f"builds for gfx906 / Vega / RDNA exist for torch 2.5 to 2.9)")

"""Exact token-chunked feed-forward: y[:, a:b] = ffn(x[:, a:b]), since a feed-forward acts on each token alone.

The hidden activation (tokens x 4*dim, often the largest tensor of a video DiT block) then lives one chunk at
a time. On its first call the chunked forward checks on a small slice that chunking changes nothing (a module
that mixes tokens fails the check) and passes through unchunked for good if it does.
"""
from __future__ import annotations

import logging
import math

import torch

from .memory import free_memory

log = logging.getLogger(__name__)

CHECK_TOKENS = 8
# share of free memory one chunk's hidden activation may take when chunks=0 (auto)
AUTO_SHARE = 0.25


def hidden_features(module: torch.nn.Module) -> int:
    """Width of the widest Linear inside the module (the hidden size of an MLP); 0 if none."""
    widths = [m.out_features for m in module.modules() if isinstance(m, torch.nn.Linear)]
    widths += [m.out_features for m in module.modules()
               if not isinstance(m, torch.nn.Linear) and isinstance(getattr(m, "out_features", None), int)]
    return max(widths or [0])


class ChunkedFFN:
    """A forward replacement: call the wrapped forward on token chunks along `dim` and concatenate.

    chunks: number of chunks, 0 = from free memory at call time. It is a plain callable (no parameters), so
    installing it as `module.forward` leaves the module's parameters and state-dict keys untouched.
    """

    def __init__(self, forward, chunks: int = 0, dim: int = 1, hidden: int = 0, name: str = "ffn"):
        if chunks < 0:
            raise ValueError(f"chunks must be >= 0 (0 = auto), got {chunks}")
        self.forward = forward
        self.chunks = int(chunks)
        self.dim = dim
        self.hidden = hidden
        self.name = name
        self.verified = None  # None: not yet checked, True: exact, False: mixes tokens -> pass through
        self.calls_chunked = 0

    def __deepcopy__(self, memo):  # ComfyUI deep-copies model options on clone; the wrapped module is shared
        return self

    def chunk_count(self, x: torch.Tensor) -> int:
        n = x.shape[self.dim]
        if self.chunks > 0:
            return min(self.chunks, n)
        hidden = self.hidden or x.shape[-1] * 4
        tokens_elsewhere = x.numel() // max(1, n * x.shape[-1])
        act_bytes = 2 * n * tokens_elsewhere * hidden * x.element_size()  # pre- and post-activation
        free = free_memory(x.device) or (4 << 30)
        return max(1, min(n, math.ceil(act_bytes / max(1, free * AUTO_SHARE))))

    def _verify(self, x: torch.Tensor, args, kwargs) -> bool:
        n = x.shape[self.dim]
        if n < 2:
            return True
        probe = x.narrow(self.dim, 0, min(n, CHECK_TOKENS))
        with torch.no_grad():
            whole = self.forward(probe, *args, **kwargs)
            parts = torch.cat([self.forward(c, *args, **kwargs) for c in probe.chunk(2, dim=self.dim)], dim=self.dim)
        tol = 1e-5 if x.dtype in (torch.float32, torch.float64) else 2e-2
        ok = isinstance(whole, torch.Tensor) and whole.shape == parts.shape and torch.allclose(
            whole.float(), parts.float(), rtol=tol, atol=tol)
        if not ok:
            log.warning("%s: chunked output differs from the unchunked one (the module mixes tokens); running it "
                        "unchunked", self.name)
        return ok

    def __call__(self, x, *args, **kwargs):
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            return self.forward(x, *args, **kwargs)
        if self.verified is None:
            self.verified = self._verify(x, args, kwargs)
        chunks = self.chunk_count(x) if self.verified else 1
        if chunks <= 1:
            return self.forward(x, *args, **kwargs)
        self.calls_chunked += 1
        pieces = x.chunk(chunks, dim=self.dim)
        first = self.forward(pieces[0], *args, **kwargs)
        shape = list(first.shape)
        shape[self.dim] = x.shape[self.dim]
        out = first.new_empty(shape)
        pos = 0
        for i, piece in enumerate(pieces):
            y = first if i == 0 else self.forward(piece, *args, **kwargs)
            out.narrow(self.dim, pos, y.shape[self.dim]).copy_(y)
            pos += y.shape[self.dim]
            del y
        return out


def chunk_ffn(module: torch.nn.Module, chunks: int = 0, dim: int = 1) -> ChunkedFFN:
    """Install a ChunkedFFN as `module.forward` (an instance attribute; the class forward is untouched)."""
    if isinstance(module.__dict__.get("forward"), ChunkedFFN):
        module.forward.chunks = chunks
        return module.forward
    wrapper = ChunkedFFN(module.forward, chunks=chunks, dim=dim, hidden=hidden_features(module),
                         name=type(module).__name__)
    module.forward = wrapper
    return wrapper


def unchunk_ffn(module: torch.nn.Module) -> None:
    """Remove a forward installed by chunk_ffn."""
    if isinstance(module.__dict__.get("forward"), ChunkedFFN):
        del module.forward

"""The check that chunking is exact for a module: two different token partitions of the same input agree.

Why the check is what it is (no check short of running every call unchunked proves token-wise-ness of a black
box: a module can be token-wise on some inputs only). The check compares two different token partitions of the
same input, P (the chunks actually used) and Q (a single-token piece, then boundaries half-way inside P's
pieces, so every piece length and boundary differs from P's), on the call's own input and on a random input of
the same signature (per-feature mean and spread of the real one). If the output of a token depended on any
other token of its piece, or on the piece's length or position, P and Q would differ; the real input covers
the values the module actually sees (a module can behave differently on other values), the random one breaks
structure that can hide mixing (padding and register tokens, repeated blocks). A call whose tokens are all
identical cannot show mixing at all: it is run unchunked and decides nothing. Every probe runs on chunks only,
so the check never allocates the unchunked hidden activation (that would defeat chunking, which exists
because that activation does not fit). What it cannot see: a module whose behaviour switches on values never
seen in the probes, or on the full length alone (P and Q are both shorter); those are not feed-forwards.

Cost: the first call of each signature runs the forward four extra times (two partitions of two inputs), on
chunks only; later calls of that signature cost one dictionary look-up (state.py).

The probes run with gradients off, the module's forward hooks set aside, and its buffers and plain attributes
restored afterwards, so they leave the module as they found it (BatchNorm statistics, counters, caches).
"""
import contextlib
import copy
import logging
from collections import OrderedDict

import torch

from .chunking import run_pieces

log = logging.getLogger(__package__)  # attention_core.ffn, the logger the wrapper has always used


def check(forward, owner, x, p_sizes, dim, args, kwargs, name):
    """True: both partitions agree on the real and a random input; False: they differ or an output cannot
    be chunked; None: cannot decide (all tokens identical)."""
    first = x.narrow(dim, 0, 1)
    if torch.equal(x, first.expand_as(x)):
        return None
    q_sizes = _pieces_q(x.shape[dim], p_sizes)
    random_x = _random_like(x)
    try:
        with torch.no_grad(), _state_preserved(owner):
            for probe in (x, random_x):
                a = run_pieces(forward, probe, p_sizes, dim, args, kwargs)
                if a is None:
                    return False
                b = run_pieces(forward, probe, q_sizes, dim, args, kwargs)
                if not _close(a, b):
                    return False
                del a, b
    except torch.OutOfMemoryError:
        return None
    except Exception as e:  # noqa: BLE001 - a module that cannot run on pieces is run whole
        log.info("%s: the forward fails on token chunks (%s); running it unchunked", name, e)
        return False
    return True


def _pieces_q(n: int, p_sizes) -> list:
    """Piece lengths of the second partition: a single-token piece, then cuts half-way inside P's pieces."""
    cuts, pos = {1}, 0
    for s in p_sizes:
        if s >= 2:
            cuts.add(pos + s // 2)
        pos += s
    cuts = sorted(c for c in cuts if 0 < c < n)
    bounds = [0] + cuts + [n]
    return [b - a for a, b in zip(bounds, bounds[1:]) if b > a]


def _tolerance(dtype: torch.dtype) -> float:
    """Relative difference two partitions of a token-wise module may show (GEMM blocking depends on the row
    count): a few units in the last place of the compute dtype, scaled by the output's largest magnitude."""
    return 1e-5 if dtype in (torch.float32, torch.float64) else 2e-2


def _close(a, b) -> bool:
    """Same shape and dtype, non-finite values in the same places and equal, and max |a - b| within the
    tolerance times max |a| over the finite ones."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape \
            or a.dtype != b.dtype:
        return False
    if not a.is_floating_point() or a.numel() == 0:
        return torch.equal(a, b)
    a, b = a.detach(), b.detach()
    finite = torch.isfinite(a)
    if not torch.equal(finite, torch.isfinite(b)):
        return False
    if not bool(finite.all()):
        if not torch.equal(a[~finite].nan_to_num(0.0, 1.0, -1.0), b[~finite].nan_to_num(0.0, 1.0, -1.0)):
            return False
        a, b = a.masked_fill(~finite, 0.0), b.masked_fill(~finite, 0.0)
    compute = torch.float64 if a.dtype == torch.float64 else torch.float32
    diff = float((a.to(compute) - b.to(compute)).abs().max())
    scale = float(a.abs().max())
    return diff <= _tolerance(a.dtype) * max(scale, 1e-30)


@contextlib.contextmanager
def _state_preserved(module):
    """Run the block, then put back the module tree's buffers (values, in place), plain attributes and hook
    dicts as they were; forward hooks and pre-hooks are set aside while it runs."""
    if not isinstance(module, torch.nn.Module):
        yield
        return
    saved = []
    for m in module.modules():
        attrs = {k: (copy.copy(v) if isinstance(v, (list, dict, set)) and not k.startswith("_") else v)
                 for k, v in m.__dict__.items()}
        buffers = [(t, t.detach().clone()) for t in m._buffers.values() if isinstance(t, torch.Tensor)]
        saved.append((m, attrs, buffers))
        for hooks in ("_forward_hooks", "_forward_pre_hooks"):
            if m.__dict__.get(hooks):
                object.__setattr__(m, hooks, OrderedDict())
    try:
        yield
    finally:
        with torch.no_grad():
            for m, attrs, buffers in saved:
                m.__dict__.clear()
                m.__dict__.update(attrs)
                for t, value in buffers:
                    if t.shape == value.shape:
                        t.copy_(value)


def seeded_normal(shape, dtype, device, seed: int) -> torch.Tensor:
    """Standard normal values drawn with a fixed seed on `device`."""
    try:
        gen = torch.Generator(device=device).manual_seed(seed)
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)
    except RuntimeError:  # a device without its own generator
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(shape, generator=gen, dtype=dtype).to(device)


def _random_like(x: torch.Tensor) -> torch.Tensor:
    """Gaussian tokens with the per-feature mean and spread of x (fixed seed, drawn on x's device)."""
    reduce = list(range(x.dim() - 1))
    std, mean = torch.std_mean(x.detach(), dim=reduce, keepdim=True)
    std = std.float().nan_to_num(0.0).clamp_min(1e-3)
    noise = seeded_normal(x.shape, x.dtype, x.device, 0x7F4A7C15)
    return noise.mul_(std.to(x.dtype)).add_(mean)

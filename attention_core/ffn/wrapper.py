"""ChunkedFFN, the forward replacement of FFN chunking (the package docstring says what and why), and
chunk_ffn / unchunk_ffn that install and remove it.

An eager call: the token axis and the call's signature (signature.py), the chunk count (chunking.py), the
signature's verdict (state.py) or else the exactness check (exactness.py), then the chunked computation or the
plain call. Calls the chunking cannot represent (no tensor input, tokens along the last axis, a tensor argument
with a per-token axis, outputs that are not one tensor with one row per input token) run unchunked.

Inside torch.compile the call is decided once per traced signature (state.py) on the sizes the trace knows
(traced_sizes.py); calls with extra arguments, or whose token count must stay symbolic (marked dynamic), run unchunked
in the graph; `calls_chunked` counts eager calls only.
"""
from __future__ import annotations

import copy
import logging
import operator
from collections import OrderedDict

import torch

from . import exactness, state, traced_sizes
from .chunking import chunk_count, hidden_features, piece_sizes, run_pieces
from .signature import call_key, has_per_token_argument, signature_of, token_dim

log = logging.getLogger(__package__)  # attention_core.ffn, the logger the wrapper has always used


class ChunkedFFN:
    """A forward replacement: call the wrapped forward on token chunks along `dim` and concatenate.

    chunks: number of chunks, 0 = from free memory at call time. It is a plain callable (no parameters), so
    installing it as `module.forward` leaves the module's parameters and state-dict keys untouched.
    module: the module whose state the check must preserve (default: the bound forward's owner).
    copy.deepcopy copies the wrapped forward with the memo, so a deep copy of the module computes with the copy's
    own parameters.
    """

    def __init__(self, forward, chunks: int = 0, dim: int = 1, hidden: int = 0, name: str = "ffn", module=None):
        if chunks < 0:
            raise ValueError(f"chunks must be >= 0 (0 = auto), got {chunks}")
        self._forward = forward
        self.module = module
        self.chunks = int(chunks)
        self.dim = dim
        self.hidden = hidden
        self.name = name
        self.verdicts: OrderedDict = OrderedDict()  # signature -> True (chunk) / False (run unchunked)
        self.calls_chunked = 0
        self._trace_key = state.register(self)

    @property
    def forward(self):
        return self._forward

    @forward.setter
    def forward(self, fn):  # another function: every verdict is about the old one
        self._forward = fn
        self.verdicts.clear()

    WRAPS = "forward"

    def rewrapped(self, forward) -> "ChunkedFFN":
        """A fresh wrapper with the same settings around another forward (the same module of another model)."""
        return ChunkedFFN(forward, chunks=self.chunks, dim=self.dim, hidden=self.hidden, name=self.name)

    @property
    def verified(self):
        """Verdict of the latest checked signature (None before any)."""
        return next(reversed(self.verdicts.values())) if self.verdicts else None

    def owner(self):
        if self.module is not None:
            return self.module
        owner = getattr(self._forward, "__self__", None)
        return owner if isinstance(owner, torch.nn.Module) else None

    def chunk_count(self, x: torch.Tensor, dim: int = None) -> int:
        return chunk_count(x, self.dim if dim is None else dim, self.chunks, self.hidden)

    def _run(self, x, sizes, dim, args, kwargs):
        return run_pieces(self._forward, x, sizes, dim, args, kwargs)

    def _check(self, x, p_sizes, dim, args, kwargs):
        return exactness.check(self._forward, self.owner(), x, p_sizes, dim, args, kwargs, self.name)

    def _training(self):
        owner = self.owner()
        return bool(owner.training) if owner is not None else None

    def __call__(self, x, *args, **kwargs):
        if torch.compiler.is_dynamo_compiling():  # this thread's trace (is_compiling(): any thread's, torch 2.14)
            return self._traced_call(x, args, kwargs)
        dim = token_dim(x, self.dim)
        if dim is None or not x.is_floating_point():
            return self._forward(x, *args, **kwargs)
        n = x.shape[dim]
        chunks = self.chunk_count(x, dim)
        if chunks <= 1 or n < 2:
            return self._forward(x, *args, **kwargs)
        if has_per_token_argument(args, kwargs, dim, n):
            return self._forward(x, *args, **kwargs)  # a per-token argument: pieces would not line up
        p_sizes = [p.shape[dim] for p in x.chunk(chunks, dim=dim)]
        key = call_key(x, args, kwargs, self._training())
        verdict = self.verdicts.get(key)
        if verdict is None:
            verdict = self._check(x, p_sizes, dim, args, kwargs)
            if verdict is not None:
                state.remember(self.verdicts, key, verdict)
                if not verdict:
                    log.warning("%s: chunked output differs from the unchunked one or cannot be assembled (the "
                                "module mixes tokens or changes their number); running it unchunked", self.name)
        else:
            self.verdicts.move_to_end(key)
        if not verdict:
            return self._forward(x, *args, **kwargs)
        out = self._run(x, p_sizes, dim, args, kwargs)
        if out is None:  # shapes changed since the check: the plain call is the answer
            self.verdicts[key] = False
            return self._forward(x, *args, **kwargs)
        self.calls_chunked += 1
        return out

    def _traced_call(self, x, args, kwargs):
        """The call inside a torch.compile trace: no Python state is read or written in the graph (no guard, no
        recompile, no graph break). Whether and in how many chunks to run is decided once per traced signature by
        state.decide_while_tracing, which dynamo runs as plain Python while it traces (a constant of the graph), on
        the sizes traced_sizes.note reads off the trace: each size's value at trace time, and whether it must stay
        symbolic. Calls with extra arguments run unchunked. A token count that must stay symbolic (its expression
        holds a size marked by torch._dynamo.mark_dynamic, on the block's input or any other: a guard pinning it
        fails the compile) runs unchunked; any other token count is made concrete with operator.index (dynamo
        specializes the graph on it, each new token count compiles its own graph, as with dynamic=False; int()
        does not specialize), since the pieces need it. The other sizes are never made concrete: the decision
        takes their values at trace time (a batch marked dynamic stays one graph for every batch)."""
        dim = token_dim(x, self.dim)
        if dim is None or not x.is_floating_point() or args or kwargs:
            return self._forward(x, *args, **kwargs)
        key, dim = operator.index(self._trace_key), operator.index(dim)  # both may be traced as symbolic ints
        traced_sizes.note(key, x)
        chunks = state.decide_while_tracing(key, dim, x.dtype, x.device, self._training())
        if chunks <= 1:
            return self._forward(x)
        n = operator.index(x.shape[dim])  # not marked (the decision said so): specialized, the pieces need it
        out = self._run(x, piece_sizes(n, chunks), dim, (), {})
        return self._forward(x) if out is None else out

    def decide(self, shape, dtype, device, dim, training) -> int:
        """Chunks for a call without extra arguments of this signature (0: run unchunked), from the verdict of an
        earlier eager call of the same signature, else from the check run on two random inputs of the signature
        (the real input is not available while tracing: the checked values are standard normal, not the real
        input's statistics)."""
        if shape[dim] < 2:
            return 0
        probe = exactness.seeded_normal(shape, dtype, device, 0x5EED)
        chunks = self.chunk_count(probe, dim)
        if chunks <= 1:
            return 0
        key = (("T", tuple(shape), dtype, probe.device), signature_of(()), signature_of({}), training)
        verdict = self.verdicts.get(key)
        if verdict is None:
            verdict = self._check(probe, piece_sizes(shape[dim], chunks), dim, (), {})
            if verdict is not None:
                self.verdicts[key] = verdict
                if not verdict:
                    log.warning("%s: chunked output differs from the unchunked one or cannot be assembled (the "
                                "module mixes tokens or changes their number); the compiled graph runs it "
                                "unchunked", self.name)
        return chunks if verdict else 0

    def __deepcopy__(self, memo):
        new = copy.copy(self)
        memo[id(self)] = new
        new._forward = copy.deepcopy(self._forward, memo)
        new.module = copy.deepcopy(self.module, memo)
        new.verdicts = OrderedDict(self.verdicts)
        new._trace_key = state.register(new)
        return new


def chunk_ffn(module: torch.nn.Module, chunks: int = 0, dim: int = 1) -> ChunkedFFN:
    """Install a ChunkedFFN as `module.forward` (an instance attribute; the class forward is untouched)."""
    if isinstance(module.__dict__.get("forward"), ChunkedFFN):
        module.forward.chunks = chunks
        module.forward.dim = dim
        return module.forward
    wrapper = ChunkedFFN(module.forward, chunks=chunks, dim=dim, hidden=hidden_features(module),
                         name=type(module).__name__)
    module.forward = wrapper
    return wrapper


def unchunk_ffn(module: torch.nn.Module) -> None:
    """Remove a forward installed by chunk_ffn."""
    if isinstance(module.__dict__.get("forward"), ChunkedFFN):
        del module.forward

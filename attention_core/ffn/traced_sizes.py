"""What a torch.compile trace knows about an FFN input's sizes: each size's value at trace time, and which sizes must
stay symbolic.

dynamo makes a size symbolic for three reasons: `dynamic=True`, automatic dynamic shapes (the second size it sees),
and `torch._dynamo.mark_dynamic`. Only the last forbids specializing it: a guard that pins a marked size to one value
fails the compile (ConstraintViolationError, with `fullgraph` True or False). The FFN's input is usually an
intermediate of the block (a norm's output), not the marked input, so the mark cannot be read off the tensor; it is
read off the trace instead: a size must stay symbolic when its expression contains a symbol of a size marked dynamic
without `warn_only` (dynamo's own record of the marks: the tracked inputs' constraint_sizes).

Traced code cannot tell a symbolic size from an int (dynamo traces both as int), so `note(x)` asks dynamo with
torch._dynamo.comptime: the callback runs as plain Python while dynamo traces, with x's fake tensor (symbolic sizes
and their trace-time values), and leaves a `Sizes` record for this thread, which the chunking decision
(state.decide_while_tracing, itself plain Python at trace time) takes right after. Outside a trace (eager calls, or
tests that stand in for one) the record holds the tensor's own sizes, none symbolic. Where the trace cannot be read
(a torch whose dynamo internals moved), every symbolic size counts as one that must stay symbolic: the call then runs
unchunked, never a failed compile.
"""
from __future__ import annotations

import dataclasses
import threading

import torch
from torch._dynamo.comptime import comptime

_notes = threading.local()  # .sizes: (wrapper key, Sizes) left by note() for the decision that follows it


@dataclasses.dataclass(frozen=True)
class Sizes:
    """An FFN input's sizes as the trace sees them: `values` (each size at trace time, an int), `symbolic` (the axes
    whose size is symbolic in the graph) and `pinned` (the symbolic axes that must stay symbolic: marked dynamic)."""
    values: tuple
    symbolic: frozenset = frozenset()
    pinned: frozenset = frozenset()


def note(key: int, x: torch.Tensor) -> None:
    """Leave the sizes of x for the decision of wrapper `key` (state.decide_while_tracing): read from the trace under
    torch.compile, from x itself otherwise."""
    comptime(_note_traced, lambda: _leave(key, Sizes(tuple(int(s) for s in x.shape))))


def take(key: int):
    """The Sizes note() left for wrapper `key` on this thread, or None (then nothing is known: run unchunked)."""
    left = getattr(_notes, "sizes", None)
    _notes.sizes = None
    return left[1] if left is not None and left[0] == key else None


def _leave(key, sizes) -> None:
    _notes.sizes = (key, sizes)


def _note_traced(ctx) -> None:
    """comptime callback (plain Python while dynamo traces note()): the locals `key` and `x` of note()'s frame."""
    _notes.sizes = None
    try:
        key = ctx.get_local("key").as_python_constant()
        sizes = sizes_of(ctx.get_local("x").as_fake(), _marked_symbols(ctx))
    except Exception:  # noqa: BLE001 - a trace we cannot read: nothing known, the call runs unchunked
        return
    if sizes is not None:
        _notes.sizes = (key, sizes)


def sizes_of(fake: torch.Tensor, marked) -> Sizes | None:
    """Sizes of a (fake) tensor whose sizes may be SymInts; `marked`: the symbols of sizes marked dynamic, or None
    when unknown (then every symbolic size is pinned). None when a symbolic size has no trace-time value (unbacked)."""
    values, symbolic, pinned = [], set(), set()
    for axis, size in enumerate(fake.shape):
        if not isinstance(size, torch.SymInt):
            values.append(int(size))
            continue
        node = size.node
        free = node.expr.free_symbols
        if not free:
            values.append(int(node.expr))
            continue
        if not node.has_hint():
            return None
        values.append(int(node.hint))
        symbolic.add(axis)
        if marked is None or free & marked:
            pinned.add(axis)
    return Sizes(tuple(values), frozenset(symbolic), frozenset(pinned))


def _marked_symbols(ctx):
    """The symbols of the traced frame's input sizes marked dynamic (constraint_sizes without warn_only: automatic
    dynamic shapes mark theirs warn_only), or None when dynamo's record cannot be read."""
    try:
        tracked = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator().output.tracked_fakes
        marked = set()
        for fake_input in tracked:
            constraints = getattr(fake_input.symbolic_context, "constraint_sizes", None) or ()
            for axis, constraint in enumerate(constraints):
                if constraint is None or getattr(constraint, "warn_only", False):
                    continue
                size = fake_input.fake.shape[axis]
                if isinstance(size, torch.SymInt):
                    marked |= size.node.expr.free_symbols
        return marked
    except Exception:  # noqa: BLE001 - dynamo's internals moved: every symbolic size counts as marked
        return None

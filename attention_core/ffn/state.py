"""The state of FFN chunking: one verdict per call signature, and the registry a compiled graph finds its wrapper by.

Verdicts (True: chunk, False: run unchunked) are kept per wrapper for at most MAX_SIGNATURES distinct signatures;
the least recently used is forgotten first.

Inside torch.compile the wrapper reads and writes no Python state in the graph (fullgraph=True, no recompile):
the chunk count and the verdict are decided once per traced signature as plain Python while dynamo traces
(torch.compiler.assume_constant_result), from an eager call's verdict when there is one, else from the check on two
seeded random inputs of the call's shape (the real input does not exist while tracing). The shape is the one
traced_sizes.note left for this call (each size's value at trace time, and which sizes must stay symbolic), so no
size is made concrete to decide. torch <= 2.5's assume_constant_result takes only constant arguments, so the
wrapper travels as an int key (`register`) and dtype and device as strings.
"""
import itertools
import weakref

import torch

from . import traced_sizes

# verdicts kept per wrapper (distinct call signatures); the oldest is forgotten first
MAX_SIGNATURES = 64

_TRACED_WRAPPERS = weakref.WeakValueDictionary()  # key -> ChunkedFFN
_trace_keys = itertools.count(1)


def remember(verdicts, key, verdict) -> None:
    """Record the verdict of a signature, forgetting the oldest beyond MAX_SIGNATURES."""
    verdicts[key] = verdict
    while len(verdicts) > MAX_SIGNATURES:
        verdicts.popitem(last=False)


def register(wrapper) -> int:
    """An int key for _decide_by_key (a compiled graph's decision is looked up by a constant, not the object)."""
    key = next(_trace_keys)
    _TRACED_WRAPPERS[key] = wrapper
    return key


def decide_while_tracing(key: int, dim: int, dtype, device, training) -> int:
    """Chunks for the call of wrapper `key` whose sizes traced_sizes.note just left (0: run unchunked), a constant
    of the graph: 0 when the sizes are unknown or the token axis must stay symbolic (marked dynamic: the pieces
    need its value). key and dim must be constants (operator.index them first: dynamo may trace an int attribute
    as symbolic under dynamic=True)."""
    return _decide_by_key(key, dim, str(dtype).replace("torch.", ""), str(device), training)


@torch.compiler.assume_constant_result
def _decide_by_key(key, dim, dtype_name, device_name, training) -> int:
    """Run by dynamo as plain Python at trace time; its result is a constant of the graph."""
    sizes = traced_sizes.take(key)
    wrapper = _TRACED_WRAPPERS.get(key)
    if sizes is None or wrapper is None or dim in sizes.pinned:
        return 0
    with torch.no_grad():
        return wrapper.decide(sizes.values, getattr(torch, dtype_name), torch.device(device_name), dim, training)

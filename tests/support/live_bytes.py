"""Peak bytes of the tensors alive at once while torch ops run: a measure of transient memory that works on the CPU.

LiveBytes is a TorchDispatchMode: after every aten op it drops the storages that have been freed (weak refs) and
adds the storages of the op's outputs, so `peak` is the most bytes held at once by tensors created inside the
mode: a storage first seen as an op's input (a tensor made before the mode, or a view of one) is not counted.
Views share their base's storage and count once.
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = {}  # storage data_ptr -> (weak ref, bytes)
        self.outside = set()  # data_ptrs of storages made before the mode
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for ptr in [ptr for ptr, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[ptr]  # first: a freed block's address may be handed out again
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.live:
                self.outside.add(t.untyped_storage().data_ptr())
        out = func(*args, **(kwargs or {}))
        for ptr in [ptr for ptr, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[ptr]
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr and ptr not in self.live and ptr not in self.outside:
                    self.live[ptr] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def peak_bytes(fn, *args, **kwargs) -> int:
    """The peak live bytes of tensors created while fn(*args, **kwargs) runs."""
    mode = LiveBytes()
    with mode:
        fn(*args, **kwargs)
    return mode.peak

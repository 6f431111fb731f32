"""The raw ops' documented import path: `from attention_core.ops import attention_forward, attention_backward`.

The README documented this path as public API before the ops moved into the kernel (attention_core/kernel/ops.py,
where they live and are documented); this module re-exports them so that code written against it keeps working.
"""
from .kernel.ops import attention_backward, attention_forward

__all__ = ["attention_forward", "attention_backward"]

"""torch.autocast regions for tests on a CPU-only machine, including the ones only a GPU's torch.autocast enters.

torch's C++ autocast reads one thing: this thread's state per device type (enabled, dtype), which torch.autocast's
__enter__ sets after its Python checks. The CPU's torch.autocast refuses float32 and float64 (warns, leaves autocast
off) while CUDA's accepts float32 (WanVideoWrapper's fp32 base precision runs its model under it), and a CPU-only
torch refuses CUDA's altogether; autocast_state() sets the state such a torch.autocast leaves, so the casts it
causes can be checked here."""
import contextlib
import warnings

import torch


@contextlib.contextmanager
def autocast_state(device_type, dtype):
    """This thread's autocast state as torch.autocast(device_type, dtype=dtype).__enter__ leaves it where the device
    type accepts the dtype, set directly; restored on exit."""
    enabled, old = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    torch.set_autocast_enabled(device_type, True)
    torch.set_autocast_dtype(device_type, dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled(device_type, enabled)
        torch.set_autocast_dtype(device_type, old)


@contextlib.contextmanager
def refused(dtype):
    """torch.autocast("cpu", dtype) for a dtype the CPU's autocast refuses: torch warns and leaves autocast off."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        region = torch.autocast("cpu", dtype=dtype)
    assert any("autocast" in str(w.message) for w in caught) and not region._enabled
    with region:
        yield


AUTOCASTS = {
    "cpu-bf16": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "cpu-fp16": lambda: torch.autocast("cpu", dtype=torch.float16),
    "cpu-fp32-refused": lambda: refused(torch.float32),
    "cpu-fp64-refused": lambda: refused(torch.float64),
    "state-fp32": lambda: autocast_state("cpu", torch.float32),  # what CUDA's torch.autocast(dtype=float32) leaves
    "cuda-bf16-cpu-tensors": lambda: autocast_state("cuda", torch.bfloat16),  # not the tensors' device type
}

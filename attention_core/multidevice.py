"""One attention call over several devices of one process: heads split into groups, one group per device.

Attention is independent per head, so splitting the heads is exact: device i gets query heads [a_i, b_i) (and, under
GQA, the key/value heads they use), computes them with the engine, and the outputs are concatenated on the source
device. Transfers are O(N*H*D) (q, k, v there, out back) against O(N^2*H*D) attention work. Devices run
concurrently: one thread per device, each on its device's own stream. The copies are autograd-differentiable, so backward
runs each group's recompute backward on its device and sends the gradients back.

Under torch.func transforms (grad, vmap, jvp, jacrev, ...), forward-mode AD (dual tensors), a torch.compile trace
and a tensor subclass mode (make_fx / torch.export / AOT tracing, fake tensors) the groups run one after the other
in the calling thread instead: the transforms' state, the dual tensors' tangents, dynamo's tracing and the modes
belong to that thread, and worker threads would silently compute without them (zero gradients and tangents,
operations missing from the traced graph). The result is the same, exactly; only the devices no longer overlap.
Each question is asked of this thread only: another thread compiling changes nothing here.

With count_as (attention_core.kernel.counts) the call is counted once, by the first group's engine call.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import List, Sequence

import torch

from .kernel.autocast import autocast_inputs
from .sdpa import scaled_dot_product_attention
from .kernel.tangents import forward_mode_active

log = logging.getLogger(__name__)

__all__ = ["scaled_dot_product_attention_on_devices", "plan_head_split", "HeadGroup"]


@dataclass(frozen=True)
class HeadGroup:
    device: torch.device
    kv_heads: slice  # key/value heads of this group
    q_heads: slice  # the query heads that use them

    def describe(self) -> str:
        return (f"{self.device}: query heads {self.q_heads.start}-{self.q_heads.stop - 1}"
                f" ({self.q_heads.stop - self.q_heads.start})")


def plan_head_split(q_heads: int, kv_heads: int, devices: Sequence) -> List[HeadGroup]:
    """Contiguous groups of key/value heads, as even as possible, the first devices taking the remainder; a device
    gets nothing when there are fewer kv heads than devices. Query head h uses kv head h // (q_heads / kv_heads)."""
    if not devices:
        raise ValueError("scaled_dot_product_attention_on_devices: devices is empty; list at least one, e.g. "
                         "['cuda:0', 'cuda:1']")
    if kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"scaled_dot_product_attention_on_devices: {q_heads} query heads do not group over "
                         f"{kv_heads} key/value heads")
    g = q_heads // kv_heads
    n = len(devices)
    groups, start = [], 0
    for i, dev in enumerate(devices):
        size = kv_heads // n + (1 if i < kv_heads % n else 0)
        if size:
            groups.append(HeadGroup(torch.device(dev), slice(start, start + size), slice(start * g, (start + size) * g)))
        start += size
    return groups


def _mask_for(mask, group: HeadGroup, q_heads: int):
    if mask is None:
        return None
    if mask.dim() >= 3 and mask.shape[-3] == q_heads and q_heads > 1:
        return mask[..., group.q_heads, :, :]
    return mask


def _attend(group, q, k, v, mask, args, engine_kwargs):
    """This group's heads copied to its device (differentiable copies) and attended there (engine_kwargs as this
    group gets them: _group_kwargs)."""
    dev = group.device
    qg = q[..., group.q_heads, :, :].to(dev, non_blocking=True)
    kg = k[..., group.kv_heads, :, :].to(dev, non_blocking=True)
    vg = v[..., group.kv_heads, :, :].to(dev, non_blocking=True)
    mg = mask.to(dev, non_blocking=True) if mask is not None else None
    dropout_p, is_causal, scale, enable_gqa = args
    return scaled_dot_product_attention(qg, kg, vg, mg, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa,
                                        **engine_kwargs)


def _run_group(group, q, k, v, mask, args, engine_kwargs, grad_enabled, inference, measure, results, i):
    """In a worker thread: copy this group's heads to its device, attend there (on that device's current stream,
    so devices run concurrently and the caching allocator sees one stream per tensor). With `measure`, wait for the
    device and read its peak memory (this resets the device's peak statistics)."""
    dev = group.device
    cuda = dev.type == "cuda"
    with torch.inference_mode(inference), torch.set_grad_enabled(grad_enabled), \
            (torch.cuda.device(dev) if cuda else contextlib.nullcontext()):
        if cuda and measure:
            torch.cuda.reset_peak_memory_stats(dev)
        out = _attend(group, q, k, v, mask, args, engine_kwargs)
        peak = None
        if cuda and measure:
            torch.cuda.synchronize(dev)
            peak = torch.cuda.max_memory_allocated(dev)
    results[i] = (out, peak, threading.get_ident())


def _group_kwargs(engine_kwargs: dict, i: int) -> dict:
    """The engine options of group i: count_as for the first group only (one count per attention call)."""
    if i == 0 or not engine_kwargs.get("count_as"):
        return engine_kwargs
    return {**engine_kwargs, "count_as": ""}


def in_calling_thread_only(tensors) -> bool:
    """Whether the head groups must run in the calling thread: while dynamo traces this call, under a tensor
    subclass mode (make_fx / torch.export / AOT tracing, fake tensors: TorchDispatchModes on this thread's stack),
    under a torch.func transform, or with forward-mode AD dual tensors among `tensors` (None allowed). That state
    is the calling thread's and worker threads would compute without it. (Not torch.compiler.is_compiling(): on
    torch 2.14 it answers True on every thread while any thread compiles.)"""
    if torch.compiler.is_dynamo_compiling():
        return True
    if torch._C._len_torch_dispatch_stack() > 0:
        return True
    if torch._C._are_functorch_transforms_active():
        return True
    return forward_mode_active([t if isinstance(t, torch.Tensor) else None for t in tensors])


def _join(outs, device, return_lse: bool):
    """The groups' results on `device`, heads concatenated (with return_lse, lse [..., H, Lq] joins on dim -2)."""
    if return_lse:
        return (torch.cat([o[0].to(device) for o in outs], dim=-3), torch.cat([o[1].to(device) for o in outs], dim=-2))
    return torch.cat([o.to(device) for o in outs], dim=-3)


def scaled_dot_product_attention_on_devices(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                            scale=None, enable_gqa=False, *, devices, log_level=logging.DEBUG,
                                            **engine_kwargs):
    """torch's SDPA semantics (heads on dim -3), computed with the heads split over `devices`; the result is on
    query's device. engine_kwargs go to attention_core.scaled_dot_product_attention on every device (with
    return_lse=True the result is (out, lse), lse [..., H, Lq] as that function's). The split,
    the bytes copied to each device and (CUDA) each device's peak memory are logged at `log_level`."""
    if not isinstance(query, torch.Tensor) or query.dim() < 3:
        raise ValueError(f"scaled_dot_product_attention_on_devices: query must be a tensor [..., H, L, E]; got "
                         f"{getattr(query, 'shape', type(query).__name__)}")
    H, Hkv = query.shape[-3], key.shape[-3]
    if Hkv != H and not enable_gqa:
        raise ValueError(f"scaled_dot_product_attention_on_devices: q has {H} heads, k/v {Hkv}; pass "
                         f"enable_gqa=True for grouped-query attention")
    groups = plan_head_split(H, Hkv, list(devices))
    # autocast is per thread and worker threads start without it: cast here, in the caller's thread, as torch's SDPA
    query, key, value, attn_mask = autocast_inputs(query, key, value, attn_mask)  # would be cast (mask included)
    args = (dropout_p, is_causal, scale, enable_gqa)
    if len(groups) == 1 and groups[0].device == query.device:
        return scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                            enable_gqa=enable_gqa, **engine_kwargs)
    if in_calling_thread_only((query, key, value, attn_mask)):  # see the module docstring
        if torch.compiler.is_dynamo_compiling():  # traced: no logging, no device switch (tensors carry their device)
            outs = [_attend(g, query, key, value, _mask_for(attn_mask, g, H), args, _group_kwargs(engine_kwargs, i))
                    for i, g in enumerate(groups)]
            return _join(outs, query.device, bool(engine_kwargs.get("return_lse")))
        results = []
        for i, g in enumerate(groups):
            with torch.cuda.device(g.device) if g.device.type == "cuda" else contextlib.nullcontext():
                out = _attend(g, query, key, value, _mask_for(attn_mask, g, H), args, _group_kwargs(engine_kwargs, i))
            results.append((out, None, threading.get_ident()))
        return _joined_and_logged(results, groups, query, key, value, engine_kwargs, log_level)
    results = [None] * len(groups)
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    measure = log.isEnabledFor(log_level)
    errors = [None] * len(groups)

    def work(i, g):
        try:
            _run_group(g, query, key, value, _mask_for(attn_mask, g, H), args, _group_kwargs(engine_kwargs, i), grad,
                       inference, measure, results, i)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread below
            errors[i] = e

    # One thread per device group, all started before any is joined: a thread pool may hand a finished worker the
    # next group, and then the devices would run one after the other.
    threads = [threading.Thread(target=work, args=(i, g), name=f"attention-device-{i}", daemon=True)
               for i, g in enumerate(groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e  # a device's error (out of memory: the engine's message) is raised here
    return _joined_and_logged(results, groups, query, key, value, engine_kwargs, log_level)


def _joined_and_logged(results, groups, query, key, value, engine_kwargs, log_level):
    """The joined result of the groups' (out, peak or None, thread id); the split logged at log_level."""
    out = _join([r[0] for r in results], query.device, bool(engine_kwargs.get("return_lse")))
    if log.isEnabledFor(log_level):
        inputs = lambda g: sum(t[..., s, :, :].numel() * t.element_size()  # noqa: E731
                               for t, s in ((query, g.q_heads), (key, g.kv_heads), (value, g.kv_heads)))
        log.log(log_level, "attention on %d devices, %s: %s", len(groups), tuple(query.shape), "; ".join(
            f"{g.describe()}, {inputs(g) / 2**20:.1f} MB in" + (f", peak {r[1] / 2**20:.0f} MB" if r[1] else "")
            for g, r in zip(groups, results)))
    return out

"""Does this device need tiled attention? Arch tables, a probe of torch's SDPA backends, and a plain report.

The probe is the ground truth: each fused backend (flash, memory-efficient, cuDNN) is run on tiny tensors as its
own aten op (never through torch's process-global backend switches, which would break other threads' SDPA). The arch tables only explain the verdict and stand in where the probe cannot run.
Environment override: TILED_ATTENTION=force (always use the engine) | off (never) | auto (default).
"""
from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

ENV_VAR = "TILED_ATTENTION"

# AMD archs with no fused attention in any PyTorch backend (CK needs MFMA / AOTriton rejects them / Triton dropped)
AMD_NO_FUSED = {"gfx803", "gfx900", "gfx906", "gfx908", "gfx1010", "gfx1011", "gfx1012",
                "gfx1030", "gfx1031", "gfx1032", "gfx1033", "gfx1034", "gfx1035", "gfx1036"}
# AMD archs AOTriton serves
AMD_FUSED_PREFIXES = ("gfx90a", "gfx942", "gfx950", "gfx11", "gfx120")
# AMD archs with bf16 arithmetic (MFMA / WMMA / dot instructions); the rest emulate it slowly
AMD_BF16_PREFIXES = ("gfx908", "gfx90a", "gfx94", "gfx95", "gfx11", "gfx12")

_cache: dict = {}


@dataclass
class DeviceReport:
    device: str
    name: str
    vendor: str  # "amd" | "nvidia" | "intel" | "apple" | "cpu" | "unknown"
    arch: Optional[str]  # full gcnArchName, e.g. "gfx906:sramecc+:xnack-"
    gfx: Optional[str]  # "gfx906"
    sm: Optional[str]  # NVIDIA compute capability, "8.6"
    bf16_hardware: bool
    fused_backends: list = field(default_factory=list)  # torch SDPA backends that ran in the probe
    probed: bool = False
    known_no_fused: bool = False
    needs_tiled_attention: bool = False
    reason: str = ""
    override: Optional[str] = None

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        arch = self.arch or (f"sm_{self.sm.replace('.', '')}" if self.sm else "")
        fused = ", ".join(self.fused_backends) or "none"
        verdict = "needs tiled attention" if self.needs_tiled_attention else "has fused attention"
        return (f"{self.device} ({self.name}{', ' + arch if arch else ''}): {verdict}; fused SDPA backends: {fused}; "
                f"bf16 hardware: {'yes' if self.bf16_hardware else 'no'}; {self.reason}")

    def text(self) -> str:
        lines = [f"device: {self.device}", f"name: {self.name}", f"vendor: {self.vendor}"]
        if self.arch:
            lines.append(f"arch: {self.arch}")
        if self.sm:
            lines.append(f"compute capability: {self.sm}")
        lines += [f"bf16 hardware: {'yes' if self.bf16_hardware else 'no'}",
                  f"fused SDPA backends that run: {', '.join(self.fused_backends) or 'none'}"
                  + ("" if self.probed else " (not probed)"),
                  f"needs tiled attention: {'yes' if self.needs_tiled_attention else 'no'}",
                  f"why: {self.reason}"]
        if self.override:
            lines.append(f"override: {ENV_VAR}={self.override}")
        return "\n".join(lines)


def gfx_of(arch: Optional[str]) -> Optional[str]:
    """'gfx906:sramecc+:xnack-' -> 'gfx906'."""
    if not arch:
        return None
    m = re.match(r"(gfx[0-9a-f]+)", arch.strip().lower())
    return m.group(1) if m else None


def amd_bf16_hardware(gfx: Optional[str]) -> bool:
    return bool(gfx) and gfx.startswith(AMD_BF16_PREFIXES)


def _device_of(device) -> torch.device:
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def _env_override() -> Optional[str]:
    v = os.environ.get(ENV_VAR, "").strip().lower()
    if v in ("1", "on", "force", "true", "yes"):
        return "force"
    if v in ("0", "off", "false", "no", "never"):
        return "off"
    return None


def _fused_ops(device: torch.device) -> dict:
    """torch's fused SDPA kernels as plain aten ops, each returning the attention output first."""
    aten = torch.ops.aten
    if device.type == "cpu":
        return {"flash": lambda q: aten._scaled_dot_product_flash_attention_for_cpu(q, q, q)[0]}
    ops = {"flash": lambda q: aten._scaled_dot_product_flash_attention(q, q, q)[0],
           "efficient": lambda q: aten._scaled_dot_product_efficient_attention(q, q, q, None, False)[0]}
    if hasattr(aten, "_scaled_dot_product_cudnn_attention"):
        ops["cudnn"] = lambda q: aten._scaled_dot_product_cudnn_attention(q, q, q, None, False, 0.0, False)[0]
    return ops


def probe_fused_backends(device: torch.device) -> list:
    """Names of torch's fused SDPA backends that run on `device` (fp16 on GPUs, fp32 on the CPU) and agree with
    the math backend. Each kernel is called as its own aten op: torch's process-global backend switches
    (`sdpa_kernel`) are never touched, so SDPA calls in other threads are unaffected while this runs."""
    dtype = torch.float32 if device.type == "cpu" else torch.float16
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(1, 2, 32, 64, generator=gen).to(device=device, dtype=dtype)
    want = torch.softmax((q.double() @ q.double().transpose(-1, -2)) / 8.0, dim=-1) @ q.double()
    working = []
    for name, op in _fused_ops(device).items():
        try:
            out = op(q)
            if out.shape == q.shape and torch.allclose(out.double(), want, atol=2e-2, rtol=2e-2):
                working.append(name)
        except Exception:  # noqa: BLE001 - a backend that cannot run here is exactly what we probe for
            continue
    return working


def bf16_hardware(device) -> bool:
    """Whether `device` computes bf16 natively (not just 'supports' it: ROCm says True for every arch)."""
    d = torch.device(device)
    if d.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(d)
        if getattr(torch.version, "hip", None):
            return amd_bf16_hardware(gfx_of(getattr(props, "gcnArchName", "")))
        return props.major >= 8
    return True


def detect(device=None, refresh: bool = False, probe: bool = True) -> DeviceReport:
    """Report for `device` (default: current accelerator, else the CPU), cached per device."""
    d = _device_of(device)
    key = (str(d), probe)
    if not refresh and key in _cache:
        report = _cache[key]
    else:
        report = _build_report(d, probe)
        _cache[key] = report
    return _apply_override(report)


def report_from_properties(device: str, name: str, *, hip: bool, arch: str = "", major: int = 0, minor: int = 0,
                           fused_backends=None) -> DeviceReport:
    """The verdict for given device properties; fused_backends=None means the probe could not run."""
    probed = fused_backends is not None
    fused = list(fused_backends or [])
    if hip:
        gfx = gfx_of(arch)
        r = DeviceReport(device=device, name=name, vendor="amd", arch=arch or None, gfx=gfx, sm=None,
                         bf16_hardware=amd_bf16_hardware(gfx), fused_backends=fused, probed=probed,
                         known_no_fused=gfx in AMD_NO_FUSED)
        if probed:
            r.needs_tiled_attention = not fused
            r.reason = (f"no fused SDPA backend runs on {gfx}" if not fused else
                        f"torch's {', '.join(fused)} attention runs on {gfx}")
        else:
            r.needs_tiled_attention = not (gfx or "").startswith(AMD_FUSED_PREFIXES)
            r.reason = (f"{gfx} is known to lack fused attention (no MFMA for CK, rejected by AOTriton)"
                        if r.known_no_fused else f"{gfx}: from the arch table")
        return r
    sm = f"{major}.{minor}"
    r = DeviceReport(device=device, name=name, vendor="nvidia", arch=None, gfx=None, sm=sm, bf16_hardware=major >= 8,
                     fused_backends=fused, probed=probed)
    if probed:
        r.needs_tiled_attention = not fused
        r.reason = "no fused SDPA backend runs here" if not fused else f"torch's {', '.join(fused)} attention runs"
    else:
        r.needs_tiled_attention = major < 5
        r.reason = f"sm_{major}{minor}: from the arch table"
    return r


def _build_report(d: torch.device, probe: bool) -> DeviceReport:
    fused = None
    if probe:
        try:
            fused = probe_fused_backends(d)
        except Exception:  # noqa: BLE001 - device unusable for the probe: fall back to the tables
            fused = None
    if d.type == "cuda":
        props = torch.cuda.get_device_properties(d)
        hip = bool(getattr(torch.version, "hip", None))
        return report_from_properties(str(d), props.name, hip=hip, arch=getattr(props, "gcnArchName", "") or "",
                                      major=props.major, minor=props.minor, fused_backends=fused)
    vendor = {"cpu": "cpu", "mps": "apple", "xpu": "intel"}.get(d.type, "unknown")
    name = {"cpu": "CPU", "mps": "Apple GPU", "xpu": "Intel GPU"}.get(d.type, d.type)
    fused_list = list(fused or [])
    r = DeviceReport(device=str(d), name=name, vendor=vendor, arch=None, gfx=None, sm=None, bf16_hardware=True,
                     fused_backends=fused_list, probed=fused is not None, needs_tiled_attention=not fused_list)
    r.reason = (f"torch's {', '.join(fused_list)} attention runs on the {name}" if fused_list
                else f"no fused SDPA backend runs on the {name}")
    return r


def _apply_override(report: DeviceReport) -> DeviceReport:
    ov = _env_override()
    if ov is None:
        return report
    r = DeviceReport(**asdict(report))
    r.override = ov
    r.needs_tiled_attention = ov == "force"
    r.reason = f"{report.reason}; forced {'on' if ov == 'force' else 'off'} by {ENV_VAR}"
    return r


def needs_tiled(device) -> bool:
    return detect(device).needs_tiled_attention

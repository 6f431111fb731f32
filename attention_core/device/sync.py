"""Waiting for a device's queued work, so that a wall-clock timing covers the kernels it launched."""


def synchronize(device) -> None:
    """Return once every kernel queued on `device` has finished: CUDA and ROCm (torch.cuda), XPU (torch.xpu), MPS
    (torch.mps, one device); another backend (DirectML's privateuseone) by reading one value back to the host, which
    an in-order queue returns only after the work queued before it. The CPU runs ops synchronously: nothing to wait
    for. Without the wait a GPU timing reads the launch, not the work (a tuned tile or a calibrated rate chosen from
    it would be wrong)."""
    import torch
    d = torch.device(device)
    if d.type == "cpu":
        return
    backend = getattr(torch, d.type, None)
    wait = getattr(backend, "synchronize", None)
    if wait is None:
        torch.zeros((), device=d).item()
    elif d.type == "mps":
        wait()
    else:
        wait(d)

"""The composition matrix (issue 22.10): every way of running the engine x every transform of torch x every way of
spreading a call, each cell exact against torch's math SDPA on float64 or one clear error naming what is
unsupported; docs/engine.md's support table is rendered from the cells (render_table) and must equal them.

  modes       eager | torch.compile, default mode, backend "aot_eager" | the same, backend "eager" (the one backend
              dynamo lets trace inside torch.func transforms) | torch.compile(fullgraph=True), backend "eager" |
              torch.compile's default (inductor), for one call under the torch.func transforms (INDUCTOR_CELLS)
  transforms  loss.backward() | torch.func grad, jvp, jacfwd, jacrev, hessian, jacrev(jacfwd), vmap |
              torch.autograd.forward_ad dual tensors
  setups      one call (attention_core.scaled_dot_product_attention) | the head split over devices (two CPU
              "devices") | Ulysses and ring (attention_core/parallel/) over a gloo world of 2 processes

The compiled function is attention with a little around it (q * 1.5 before, sin after, causal), the transform is
applied outside torch.compile (as to a compiled model), and the reference is the same transform of the same function
on torch's math SDPA, eager. For Ulysses and ring each rank holds its slice of the sequence: `backward` is compared
with torch's gradients of the whole sequence (each rank its rows); the torch.func transforms of a rank's slice have
no such meaning and must be refused. An error is clear when it is one of ERRORS; an error that torch.compile itself
raises (dynamo's own limits) must be raised by torch's math SDPA in the same cell too. The docs table's test runs on the
torch of tests/requirements-test.txt only (which cells torch.compile can trace depends on the torch version).
Inductor only where dynamo hands it little to build (torch.func around the compiled call): compiling its C++
kernels costs 10 s to 35 s cold on two cores elsewhere; tests/comfy/test_compile_fullgraph.py compiles patched models.
"""
from __future__ import annotations

import datetime
import os
import pickle
import re
import subprocess
import sys
import time
import traceback

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "docs", "engine.md")  # the table moved there from README.md
START, END = "<!-- composition matrix: start -->", "<!-- composition matrix: end -->"
WORLD = 2
TOL = 1e-10

MODES = {  # name -> torch.compile keyword arguments (None: eager)
    "eager": None,
    "compile": {"backend": "aot_eager"},
    "compile, eager backend": {"backend": "eager"},
    "fullgraph=True": {"backend": "eager", "fullgraph": True},
    "compile, inductor": {},  # torch.compile's default backend: one call under the torch.func transforms only
}
TRANSFORMS = ("backward", "grad", "jvp", "jacfwd", "jacrev", "hessian", "jacrev(jacfwd)", "vmap", "forward_ad")
SETUPS = ("one call", "head split", "Ulysses", "ring")
LOCAL, DISTRIBUTED = SETUPS[:2], SETUPS[2:]
# inductor builds C++ kernels for what it compiles (10 s for forward_ad's graphs, 35 s with backward, cold, on two
# cores); under torch.func transforms dynamo runs the call eagerly and hands it one small frame, so those are cheap
INDUCTOR_CELLS = {("one call", "compile, inductor", t) for t in TRANSFORMS if t not in ("backward", "forward_ad")}
CELLS = [(s, m, t) for s in SETUPS for m in MODES for t in TRANSFORMS
         if m != "compile, inductor" or (s, m, t) in INDUCTOR_CELLS]

# label -> (exception class name, message pattern, from torch itself?, the legend of docs/engine.md's table)
ERRORS = {
    "refused": ("NotImplementedError", r"(ulysses|ring)_attention \(rank \d of \d\): rank\(s\) \[0, 1\] rejected the "
                r"call.*(ulysses|ring)_attention does not support (torch\.func transforms \(active here: [a-z, ]+\)"
                r"|forward-mode AD \(torch\.autograd\.forward_ad dual tensors\)) across ranks", False,
                "NotImplementedError on every rank before anything is sent, naming the function and the transform: "
                "the exchanges between ranks have no batching or forward-mode rule (P = 1 runs the engine alone and "
                "is exact)"),
    # (torch >= 2.7 adds the reason: "attention_core.parallel.ulysses_attention exchanges tensors between ranks ...")
    "not traced": ("Unsupported", r"(?s)disable\(\).*\b(ulysses|ring)_attention\b", False,
                   "torch.compile(fullgraph=True) raises, naming the function: the exchanges between ranks run "
                   "eagerly, outside the graph (a graph break in the default mode)"),
    "torch": ("Unsupported", r"attempted to apply meta conversion to view functorch tensor|Attempted to wrap a dual "
              r"tensor input", True, "torch.compile(fullgraph=True) itself cannot trace this: dynamo's own error "
              "(functorch views under jvp, dual tensor inputs), raised for torch's math SDPA as well"),
}


def classify(exc: BaseException) -> str:
    """The ERRORS label an exception matches, or 'unclear error: <type>: <message>'."""
    text = f"{exc}"
    for label, (cls, pattern, _, _) in ERRORS.items():
        if type(exc).__name__ == cls and re.search(pattern, text):
            return label
    return f"unclear error: {type(exc).__name__}: {text[:300]}"


# ---------------------------------------------------------------------------------------------------------------
# the cells


def flat(x):
    """The tensors of a (nested) result, in order; None stays (a missing tangent or gradient)."""
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in flat(item)]
    return [x]


def transformed(transform, f, q, k, v, tq, tk, tv, w):
    """The result of `transform` applied to f(q, k, v) (a tensor of q's shape; w weighs it into a scalar)."""
    import torch.autograd.forward_ad as fwAD
    func = torch.func
    loss = lambda q, k, v: (f(q, k, v) * w).sum()  # noqa: E731
    if transform == "backward":
        xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = f(*xs)
        return (out.detach(),) + torch.autograd.grad((out * w).sum(), xs)
    if transform == "grad":
        return func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    if transform == "jvp":
        return func.jvp(f, (q, k, v), (tq, tk, tv))
    if transform == "jacfwd":
        return func.jacfwd(f, argnums=(0, 1))(q, k, v)
    if transform == "jacrev":
        return func.jacrev(f, argnums=(0, 2))(q, k, v)
    if transform == "hessian":
        return func.hessian(lambda q: loss(q, k, v))(q)
    if transform == "jacrev(jacfwd)":
        return func.jacrev(func.jacfwd(lambda q, k: loss(q, k, v), argnums=(0, 1)))(q, k)
    if transform == "vmap":
        return func.vmap(f, in_dims=(0, None, 0))(torch.stack([q, 0.5 * q]), k, torch.stack([v, v.flip(-1)]))
    if transform == "forward_ad":
        with fwAD.dual_level():
            out = f(fwAD.make_dual(q, tq), fwAD.make_dual(k, tk), v)
            primal, tangent = fwAD.unpack_dual(out)
            return primal.clone(), None if tangent is None else tangent.clone()
    raise ValueError(transform)


def compiled(body, mode):
    kwargs = MODES[mode]
    if kwargs is None:
        return body
    torch._dynamo.reset()  # every cell traces afresh: no cache entry of another cell (nor its recompile limit)
    return torch.compile(body, **kwargs)


def body_of(attention):
    return lambda q, k, v: attention(q * 1.5, k, v, is_causal=True).sin()


def compare(got, want) -> dict:
    got, want = flat(got), flat(want)
    if len(got) != len(want) or any(a is None for a in got):
        return {"outcome": "wrong", "message": f"{sum(a is None for a in got)} missing of {len(want)} results"}
    err = max((a.double() - b).abs().max().item() for a, b in zip(got, want))
    scale = max(b.abs().max().item() for b in want)
    return {"outcome": "exact" if err <= TOL * max(1.0, scale) else "wrong", "err": err, "scale": scale}


def run_cell(transform, attention, reference, mode, inputs) -> dict:
    t0 = time.perf_counter()
    try:
        got = transformed(transform, compiled(body_of(attention), mode), *inputs)
    except Exception as e:  # noqa: BLE001 - judged by the tests
        res = {"outcome": classify(e), "message": str(e)[:2000]}
    else:
        res = compare(got, transformed(transform, body_of(reference), *inputs))
    res["seconds"] = time.perf_counter() - t0
    return res


def local_inputs():
    g = torch.Generator().manual_seed(22)
    q, k, v, tq, tk, tv, w = (torch.randn(1, 2, 4, 4, generator=g, dtype=torch.float64) for _ in range(7))
    return q, k, v, tq, tk, tv, w


def run_local(setup, mode, transform) -> dict:
    from attention_core import scaled_dot_product_attention
    from attention_core.multidevice import scaled_dot_product_attention_on_devices
    from reference import math_sdpa
    if setup == "one call":
        attention = scaled_dot_product_attention
    else:
        def attention(*args, **kwargs):
            return scaled_dot_product_attention_on_devices(*args, devices=["cpu", "cpu"], **kwargs)
    inputs = local_inputs()
    res = run_cell(transform, attention, math_sdpa, mode, inputs)
    if res["outcome"] in ERRORS and ERRORS[res["outcome"]][2]:  # dynamo's own limit: torch's SDPA must hit it too
        try:
            transformed(transform, compiled(body_of(math_sdpa), mode), *inputs)
            res["torch"] = "exact"
        except Exception as e:  # noqa: BLE001
            res["torch"] = classify(e)
    return res


# ---------------------------------------------------------------------------------------------------------------
# the gloo world: this file re-run as `--worker RANK INIT OUT` in WORLD processes


def worker(rank, init, out_path):
    import torch.distributed as dist
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "support")]
    from attention_core import parallel
    from reference import math_sdpa
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    g = torch.Generator().manual_seed(22)
    n = 2  # tokens per rank (even: the causal ring's zigzag split)
    q, k, v, tq, tk, tv, w = (torch.randn(1, 2, n * WORLD, 4, generator=g, dtype=torch.float64) for _ in range(7))
    rows = slice(rank * n, (rank + 1) * n)
    mine = [t[:, :, rows].contiguous() for t in (q, k, v, tq, tk, tv, w)]
    ref = transformed("backward", body_of(math_sdpa), q, k, v, tq, tk, tv, w)  # the whole sequence
    want = [t[:, :, rows] for t in ref]
    results = {}
    for setup in DISTRIBUTED:
        fn = getattr(parallel, f"{setup.lower()}_attention")
        for mode in MODES:
            for transform in TRANSFORMS:
                if (setup, mode, transform) not in CELLS:
                    continue
                t0 = time.perf_counter()
                try:
                    got = transformed(transform, compiled(body_of(fn), mode), *mine)
                except Exception as e:  # noqa: BLE001 - judged by the tests
                    res = {"outcome": classify(e), "message": str(e)[:2000]}
                else:
                    res = compare(got, want) if transform == "backward" else {
                        "outcome": "ran", "message": "a result across ranks that has no reference: refuse it"}
                res["seconds"] = time.perf_counter() - t0
                results[(setup, mode, transform)] = res
        # after the refusals the group still works
        out = fn(*mine[:3], is_causal=True)
        results[(setup, "after")] = (out - math_sdpa(q, k, v, is_causal=True)[:, :, rows]).abs().max().item()
    with open(out_path, "wb") as f:
        pickle.dump(results, f)
    sys.stdout.flush()
    os._exit(0)  # as test_parallel.py's workers: no teardown race of the gloo group after the results are written


# ---------------------------------------------------------------------------------------------------------------
# test side


class Matrix:
    """The cells, each computed when first asked for: a local cell in this process (so that coverage, and with it
    tools/mutation/mutate.py, sees which test runs which line), the distributed ones by the gloo world, which starts
    with the first cell and runs alongside the local ones."""

    def __init__(self, tmp):
        self.tmp, self.cells = tmp, {}
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
        self.procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(r), "file://" +
                                        str(tmp / "rendezvous"), str(tmp / f"rank{r}.pkl")], env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(WORLD)]

    def __getitem__(self, key):
        if key not in self.cells:
            if key[0] in LOCAL:
                self.cells[key] = run_local(*key)
            else:
                self._collect_world()
        return self.cells[key]

    def _collect_world(self):
        try:
            logs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in self.procs]
        finally:
            self.close()
        for r, p in enumerate(self.procs):
            assert p.returncode == 0, f"rank {r} of the gloo world failed:\n{logs[r][-4000:]}"
        ranks = []
        for r in range(WORLD):
            with open(self.tmp / f"rank{r}.pkl", "rb") as f:
                ranks.append(pickle.load(f))
        for key in ranks[0]:
            if len(key) == 3:  # every rank must agree on the cell; rank 0's result stands for all
                outcomes = {rk[key]["outcome"] for rk in ranks}
                self.cells[key] = dict(ranks[0][key], outcome=outcomes.pop() if len(outcomes) == 1 else
                                       f"ranks differ: {[rk[key] for rk in ranks]}")
            else:
                self.cells[key] = max(rk[key] for rk in ranks)

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    m = Matrix(tmp_path_factory.mktemp("composition"))
    yield m
    m.close()


# torch older than 2.14 (measured on 2.5.1, ./dev test-oldest-torch): these cells fail INSIDE torch with an
# unclear error (dynamo's "view functorch tensors are not supported by meta conversion" under fullgraph jvp /
# jacfwd, an internal assert for vmap under compile). Never a wrong answer: every other cell there is exact or a clear error as on the pinned torch, and
# these must keep failing loudly (docs/troubleshooting.md: Limits).
OLD_TORCH_UNCLEAR = {
    **{(s, m, t): "meta conversion" for s in ("one call", "head split", "Ulysses", "ring")
       for m in ("fullgraph=True",) for t in ("jvp", "jacfwd", "jacrev(jacfwd)")},
    **{(s, m, "vmap"): "INTERNAL ASSERT" for s, m in (("one call", "compile"), ("one call", "compile, inductor"),
                                                        ("head split", "compile"))},
}
OLD_TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 14)


@pytest.mark.parametrize("setup,mode,transform", CELLS, ids=["/".join(c) for c in CELLS])
def test_cell_is_exact_or_one_clear_error(matrix, setup, mode, transform):
    res = matrix[(setup, mode, transform)]
    where = f"{setup} / {mode} / {transform}"
    known = OLD_TORCH_UNCLEAR.get((setup, mode, transform)) if OLD_TORCH else None
    if known and res["outcome"].startswith("unclear error") and known in res["outcome"] + res.get("message", ""):
        return  # a known failure inside old torch, loud (see OLD_TORCH_UNCLEAR), never a wrong answer
    assert res["outcome"] == "exact" or res["outcome"] in ERRORS, f"{where}: {res}"
    if res["outcome"] in ERRORS and ERRORS[res["outcome"]][2] and setup in LOCAL:
        assert res["torch"] == res["outcome"], (
            f"{where}: torch.compile's own error here, but torch's math SDPA gets {res['torch']}: {res['message']}")


@pytest.mark.parametrize("setup", DISTRIBUTED)
def test_the_group_works_after_the_refusals(matrix, setup):
    assert matrix[(setup, "after")] < TOL


def render_table(matrix) -> str:
    """docs/engine.md's support table (between the markers) from the cells' outcomes."""
    lines = ["| setup | mode | " + " | ".join(TRANSFORMS) + " |", "|---|---|" + "---|" * len(TRANSFORMS)]
    for setup in SETUPS:
        for mode in MODES:
            if any((setup, mode, t) in CELLS for t in TRANSFORMS):
                lines.append(f"| {setup} | {mode} | " + " | ".join(
                    matrix[(setup, mode, t)]["outcome"] if (setup, mode, t) in CELLS else "—"
                    for t in TRANSFORMS) + " |")
    used = {matrix[c]["outcome"] for c in CELLS} - {"exact"}
    lines.append("")
    lines.append("- *—*: not run (inductor builds C++ kernels there: 10 s to 35 s on two cores).")
    lines += [f"- *{label}*: {ERRORS[label][3]}." for label in ERRORS if label in used]
    return "\n".join(lines)


def readme_table() -> str:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    assert text.count(START) == 1 and text.count(END) == 1, f"docs/engine.md needs one {START} ... {END} section"
    return text.split(START)[1].split(END)[0].strip()


def pinned_torch() -> str:
    with open(os.path.join(ROOT, "tests", "requirements-test.txt"), encoding="utf-8") as f:
        return re.search(r"^torch==(\S+)", f.read(), re.M).group(1)


def test_readme_table_is_the_matrix(matrix):
    if torch.__version__.split("+")[0] != pinned_torch():
        pytest.skip(f"not applicable: docs/engine.md's table is of torch {pinned_torch()} (this is {torch.__version__}); "
                    f"the cells themselves are tested above")
    assert readme_table() == render_table(matrix), (
        "docs/engine.md's composition matrix differs from the cells; the table they give:\n" + render_table(matrix))


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    try:
        worker(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)

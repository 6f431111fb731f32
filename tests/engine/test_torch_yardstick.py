"""Where the pack means "torch's own SDPA" (the self-check's float64 reference, the benchmark's math and torch
baselines and reference, the calibration's math timing, the tests' yardstick) it calls the builtin
torch._C._nn.scaled_dot_product_attention (attention_core/device/torch_sdpa.py), never torch.nn.functional's
attribute, which the global patch and the process-wide mode replace by the engine: there the self-check compared
the engine with itself and passed whatever the engine computed."""
import ast
import pathlib

import pytest
import torch
import torch.nn.functional as F

import attention_core as ac
from attention_core.cli import bench_methods, selfcheck
from attention_core.device import torch_sdpa

PKG = pathlib.Path(ac.__file__).parent
SUPPORT = pathlib.Path(__file__).parents[1] / "support"


@pytest.fixture
def broken_engine(monkeypatch):
    """The engine deliberately wrong (every output 1.5x), wherever it is reached from: the public function, the
    global patch's route and the self-check all call attention_core.sdpa's op."""
    import attention_core.sdpa as sdpa
    real = sdpa.tiled_attention

    def wrong(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        return out * 1.5, lse
    monkeypatch.setattr(sdpa, "tiled_attention", wrong)


def test_the_builtin_is_torchs_function_while_nothing_is_patched():
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
    assert torch_sdpa.TORCH_SDPA is torch._C._nn.scaled_dot_product_attention
    with ac.patched(force=True):
        assert F.scaled_dot_product_attention is not torch._C._nn.scaled_dot_product_attention
        assert torch_sdpa.TORCH_SDPA is torch._C._nn.scaled_dot_product_attention
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


def test_selfcheck_under_the_patch_checks_the_engine_against_torch(broken_engine):
    """Red before: the reference was F.scaled_dot_product_attention, the broken engine itself under the patch."""
    assert not selfcheck.run("cpu", verbose=False)  # a broken engine fails, patch off ...
    with ac.patched(force=True):
        assert not selfcheck.run("cpu", verbose=False)  # ... and on


def test_selfcheck_under_the_patch_passes_a_sound_engine():
    with ac.patched(force=True):
        assert selfcheck.run("cpu", verbose=False)


def test_bench_baselines_are_torchs_under_the_patch(broken_engine):
    q = torch.randn(1, 2, 16, 8, generator=torch.Generator().manual_seed(0))
    want = torch._C._nn.scaled_dot_product_attention(q, q, q)
    with ac.patched(force=True):
        assert not torch.allclose(F.scaled_dot_product_attention(q, q, q), want)  # the patch routes to the engine
        for method in ("math", "torch"):
            assert torch.allclose(bench_methods.method_fn(method, {}, torch)(q, q, q), want, atol=1e-6), method


def _calls_functional_sdpa(path):
    """Line numbers in `path` calling torch.nn.functional.scaled_dot_product_attention (as F.… or spelled out)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr == "scaled_dot_product_attention":
            owner = ast.unparse(node.func.value)
            if owner in ("F", "torch.nn.functional", "functional", "nn.functional"):
                lines.append(node.lineno)
    return lines


def test_no_engine_module_and_no_yardstick_calls_torch_functionals_attribute():
    """patch.py is the one module that works on torch.nn.functional's attribute (it installs itself there)."""
    found = {str(p.relative_to(PKG.parent)): _calls_functional_sdpa(p) for p in sorted(PKG.rglob("*.py"))
             if p.name != "patch.py"}
    found["tests/support/reference.py"] = _calls_functional_sdpa(SUPPORT / "reference.py")
    assert not {p: n for p, n in found.items() if n}, found


def test_the_tests_yardstick_is_torchs_under_the_patch(broken_engine):
    from reference import reference
    q = torch.randn(1, 2, 16, 8, generator=torch.Generator().manual_seed(1))
    want = torch._C._nn.scaled_dot_product_attention(q.double(), q.double(), q.double())
    with ac.patched(force=True):
        assert torch.allclose(reference(q, q, q), want)

"""training/lora_long_context.py: PEFT LoRA training of transformers' Qwen2 on attn_implementation="tiled" gives
math SDPA's loss and LoRA gradients (packed and unpacked, gradient checkpointing on and off), within a bound relative
to torch's own fp32 error against a float64 copy; its benchmark table and its out-of-memory refusal for math."""
import argparse
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")  # pinned in tests/requirements-test.txt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/integrations/ -> root
EXAMPLE = os.path.join(ROOT, "training", "lora_long_context.py")
WHEEL_SMOKE = False  # runs the checkout's training/ script, which the wheel does not ship (tools/wheel/check.py)


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("lora_long_context_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tiny(example):
    return example.qwen25_config(2, 256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                 num_key_value_heads=2)


def _step(example, impl, dtype, packed, checkpointing):
    cfg = _tiny(example)
    # the same weights in every run: drawn in fp32, the float64 reference a copy of them (drawn in float64 they differ)
    model = example.make_model(impl, dtype="float32", checkpointing=checkpointing, random_lora=True, config=cfg)
    if dtype == "float64":
        model = model.double()
    batch = example.make_batch(96, packed, 256)
    with example.math_context(impl):
        return example.train_step(model, batch)


@pytest.mark.parametrize("packed", [False, True], ids=["one-document", "packed"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
def test_lora_loss_and_gradients_as_math_sdpa(example, packed, checkpointing):
    from attention_core.integrations import transformers as tiled_hf
    from attention_core.kernel import counts
    before = counts.calls(tiled_hf.COUNT_KEY)[0]
    loss, grads = _step(example, "tiled", "float32", packed, checkpointing)
    calls = counts.calls(tiled_hf.COUNT_KEY)[0] - before
    # 2 layers, each document its own call when packed (4 documents), once more per layer in the recomputation
    assert calls == 2 * (4 if packed else 1) * (2 if checkpointing else 1), calls
    if packed and not tiled_hf._marks_packing():
        pytest.skip(not_marked())
    loss32, grads32 = _step(example, "sdpa", "float32", packed, checkpointing)
    loss64, grads64 = _step(example, "sdpa", "float64", packed, checkpointing)
    assert set(grads) == set(grads64) and len(grads) == 16  # A and B of q, k, v, o in 2 layers
    assert all(g.abs().max() > 0 for g in grads64.values())
    err, torch_err = abs(loss.double() - loss64).item(), abs(loss32.double() - loss64).item()
    assert err <= 4 * torch_err + 4 * torch.finfo(torch.float32).eps * abs(loss64.item()), (err, torch_err)
    for name, ref in grads64.items():
        err = (grads[name].double() - ref).abs().max().item()
        torch_err = (grads32[name].double() - ref).abs().max().item()
        assert err <= 4 * torch_err + 8 * torch.finfo(torch.float32).eps * ref.abs().max().item(), (name, err,
                                                                                                     torch_err)


def test_packed_batch_is_the_collators(example):
    batch = example.make_batch(100, True, 256)
    pos = batch["position_ids"][0].tolist()
    starts = [i for i, p in enumerate(pos) if p == 0]
    assert starts == [0, 40, 70, 90]
    assert all(batch["labels"][0, s].item() == -100 for s in starts)


def test_bench_table_and_math_out_of_memory(example, monkeypatch, capsys, tmp_path):
    """--bench in-process (each run through run_case, as its subprocess would): a table row per configuration with
    the engine's and math's time, memory and the gradients' difference; where math's score matrices would not fit,
    math is not run and the row says out of memory."""
    import json
    monkeypatch.setattr(example, "_subprocess", lambda case, timeout: json.loads(json.dumps(example.run_case(case))))
    tiny = _tiny(example)
    monkeypatch.setattr(example, "qwen25_config", lambda layers, vocab, **over: tiny)
    from attention_core.integrations import transformers as tiled_hf
    packed = tiled_hf._marks_packing()  # else "sdpa" attends across the documents: another result, not a reference
    args = argparse.Namespace(tokens=[64], packed="yes" if packed else "no", gradient_checkpointing="off", layers=2, vocab=256,
                              dtype="float32", rank=8, device="cpu", timeout=60)
    rows = example.bench(args)
    assert rows[0]["diff"]["grad_rel"] < 1e-4 and rows[0]["diff"]["grads"] == 16
    monkeypatch.setattr(example, "available_bytes", lambda device: 1000)
    rows += example.bench(args)
    assert "error" not in rows[1]["engine"] and rows[1]["math"]["error"].startswith("out of memory")
    example.print_table(rows, args)
    out = capsys.readouterr().out
    assert ("| 64 | packed (4 docs) | off |" if packed else "| 64 | one document | off |") in out, out
    assert "out of memory: needs" in out


def not_marked():
    import transformers
    return (f"not applicable: transformers {transformers.__version__} on torch {torch.__version__} does not mark "
            "packed rows (its 'sdpa' attends across documents, so it is no reference for packed training); the "
            "per-document engine calls were counted above")


def test_help_runs():
    r = subprocess.run([sys.executable, EXAMPLE, "--help"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "--bench" in r.stdout and "Qwen 2.5 0.5B" in r.stdout

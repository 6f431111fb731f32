"""Kills for the engine survivors of the fresh draw of seed 547123 (docs/mutation-draws.jsonl): the version read from
pyproject.toml, the model benchmark table's "out of memory" cells, the calibration's math-SDPA size limit, the
diffusers switch's refusal count, the model case child's command line and the detection cache. Two more (a backward
scratch slot renumbered, a cleaned device name compared with <= "cpu") are listed equivalent in
tools/mutation/mutate.py; the model cases' own code got in-process tests (test_bench_models_inprocess.py)."""
from attention_core import version
from attention_core.cli import calibrate
from attention_core.cli.bench_models import measure


def test_the_version_is_the_project_tables(tmp_path):
    f = tmp_path / "pyproject.toml"
    f.write_text('[tool.x]\nversion = "0"\n\n[project]\nname = "tiled-attention"\nversion = "1.2.3"\n')
    assert version.from_pyproject(str(f)) == "1.2.3"
    f.write_text('[tool.x]\nname = "tiled-attention"\nversion = "0"\n')
    assert version.from_pyproject(str(f)) is None  # no [project] table
    f.write_text('[project]\nname = "other"\nversion = "2.0"\n')
    assert version.from_pyproject(str(f)) is None
    assert version.from_pyproject(str(tmp_path / "missing.toml")) is None


def test_a_method_that_ran_out_of_memory_says_so_in_the_table():
    rows = [{"method": "engine", "size": "4K", "ms": 10.0, "peak_mb": 5.0},
            {"method": "math", "size": "4K", "error": "OutOfMemoryError: CUDA out of memory"},
            {"method": "engine", "size": "8K", "ms": 20.0, "peak_mb": 9.0},
            {"method": "math", "size": "8K", "error": "RuntimeError: shape mismatch"}]
    text = measure.table(rows, ["engine", "math"], {}, "t")
    line4k = next(ln for ln in text.splitlines() if ln.startswith("| 4K"))
    line8k = next(ln for ln in text.splitlines() if ln.startswith("| 8K"))
    assert "out of memory" in line4k and "not run" not in line4k
    assert "not run" in line8k and "out of memory" not in line8k


def test_math_sdpa_is_calibrated_up_to_2_to_the_26_scores(monkeypatch):
    """The calibration times math SDPA only where its heads x N x N scores stay within 2^26 (256 MB of fp32): with
    its 8 heads at 1,024 and 2,048 tokens, not at 4,096; a small calibration has a math rate."""
    assert calibrate.MATH_MAX_SCORES == 1 << 26
    assert calibrate.HEADS * 2048 * 2048 <= calibrate.MATH_MAX_SCORES < calibrate.HEADS * 4096 * 4096
    monkeypatch.setattr(calibrate, "GEMM_ROWS", (16,))  # small GEMM and elementwise passes: the attention is tested
    monkeypatch.setattr(calibrate, "ELEMENTWISE_ROWS", 16)
    cal = calibrate.measure(tokens=(64,), repeats=1)
    assert cal["attention"]["math"] and cal["attention"]["math"][0]["tokens"] == 64, cal["attention"]


def test_a_refusal_names_five_reasons_and_counts_the_rest():
    from attention_core.integrations import diffusers as tiled_diffusers

    class Model:
        pass
    reasons = [f"block {i}: no" for i in range(12)]
    text = str(tiled_diffusers._refusal(Model(), reasons))
    assert text == ("tiled attention cannot switch Model: " + "; ".join(reasons[:5]) + " (and 7 more)")
    assert str(tiled_diffusers._refusal(Model(), reasons[:5])).endswith("block 4: no")


def test_a_model_case_child_runs_its_case_and_refuses_other_command_lines(capsys):
    assert measure.child_main(lambda case: {"got": case}, ["--case", '{"n": 1}']) == 0
    assert capsys.readouterr().out.strip() == '{"got": {"n": 1}}'
    assert measure.child_main(lambda case: 1 / 0, ["--case", "{}"]) == 0  # an exception is a result row
    assert capsys.readouterr().out.strip() == '{"error": "ZeroDivisionError: division by zero"}'
    for argv in (["--case"], ["{}", "--case"], ["--case", "{}", "x"]):
        assert measure.child_main(lambda case: {}, argv) == 2
        assert "internal entry" in capsys.readouterr().err


def test_detection_is_cached_per_device_until_refreshed(monkeypatch):
    from attention_core.device import detection
    built = []
    real = detection._build_report

    def counted(d, probe):
        built.append((str(d), probe))
        return real(d, probe)
    monkeypatch.setattr(detection, "_build_report", counted)
    monkeypatch.setattr(detection, "_cache", {})
    first = detection.detect("cpu")
    assert detection.detect("cpu") == first and len(built) == 1  # cached
    detection.detect("cpu", refresh=True)
    assert len(built) == 2  # refresh rebuilds
    detection.detect("cpu", probe=False)
    assert built[-1] == ("cpu", False) and len(built) == 3  # cached per (device, probe)


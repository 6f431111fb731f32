"""attention_core.device.jsonfile: atomic writes with unique temporary names, validated reads that never raise and warn
once per version of a bad file."""
import json
import logging
import os

from attention_core.device import jsonfile


def _ok(obj):
    if not isinstance(obj, dict) or not isinstance(obj.get("n"), int):
        return None, ["not a dict with an integer n"]
    return obj, []


def test_atomic_write_leaves_no_temporary_file_and_is_readable(tmp_path):
    path = str(tmp_path / "sub" / "a.json")
    jsonfile.atomic_write_json(path, {"n": 1})
    jsonfile.atomic_write_json(path, {"n": 2})
    assert os.listdir(tmp_path / "sub") == ["a.json"]
    with open(path) as f:
        assert json.load(f) == {"n": 2}


def test_atomic_write_cleans_up_when_serialising_fails(tmp_path):
    path = str(tmp_path / "a.json")
    jsonfile.atomic_write_json(path, {"n": 1})
    try:
        jsonfile.atomic_write_json(path, {"n": object()})
    except TypeError:
        pass
    else:
        raise AssertionError("an unserialisable object must raise")
    assert os.listdir(tmp_path) == ["a.json"]  # the old file intact, no temporary left
    with open(path) as f:
        assert json.load(f) == {"n": 1}


def test_bad_files_give_none_and_one_warning_per_version(tmp_path, caplog):
    path = str(tmp_path / "a.json")
    cache = {}
    assert jsonfile.load_json_validated(path, _ok, cache) is None  # missing: silent
    assert not caplog.records
    for text in ("{not json", "[1, 2]", '{"n": "x"}', "\xff\xfe"):
        with open(path, "w", encoding="latin-1") as f:
            f.write(text)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="attention_core.device.jsonfile"):
            for _ in range(3):
                assert jsonfile.load_json_validated(path, _ok, cache, what="test file") is None
        assert len(caplog.records) == 1 and path in caplog.records[0].getMessage(), text
    jsonfile.atomic_write_json(path, {"n": 3})
    assert jsonfile.load_json_validated(path, _ok, cache) == {"n": 3}


def test_a_validator_that_raises_does_not_crash_the_reader(tmp_path, caplog):
    path = str(tmp_path / "a.json")
    jsonfile.atomic_write_json(path, {"n": 1})

    def broken(obj):
        raise KeyError("boom")
    with caplog.at_level(logging.WARNING, logger="attention_core.device.jsonfile"):
        assert jsonfile.load_json_validated(path, broken) is None
    assert len(caplog.records) == 1

"""JSON files on the user's disk as untrusted input: atomic writes, validated reads with one warning per bad file.

    atomic_write_json(path, obj)                 write to a unique temporary file in the same directory, then
                                                 os.replace: a reader sees the old file or the new one, never a
                                                 partial one, and concurrent writers never share a temporary name
    load_json_validated(path, validate, cache)   the parsed and validated content, or None (missing, unreadable,
                                                 not JSON, or rejected by `validate`); problems are logged as ONE
                                                 warning naming the file, once per version of the file

`validate(obj) -> (value, problems)`: `value` is what the caller gets (None: nothing usable), `problems` a list of
short texts (an empty list: the file was fine). Nothing here raises for a bad file.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from typing import Any, Callable, List, Optional, Tuple

log = logging.getLogger(__name__)

Validator = Callable[[Any], Tuple[Any, List[str]]]


def atomic_write_json(path: str, obj, indent: Optional[int] = 1) -> str:
    """Write `obj` as JSON to `path` atomically (unique temporary file in the same directory + os.replace)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=indent)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes the file private; a profile is not a secret
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def _stat_key(path: str):
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size, st.st_ino


def load_json_validated(path: str, validate: Validator, cache: Optional[dict] = None, what: str = "file",
                        hint: str = "") -> Any:
    """The validated content of the JSON file `path`, or None. `cache` (a dict the caller owns) keeps the result
    per path until the file changes (mtime, size or inode), so a bad file warns once, not on every call. `what`
    names the file in the warning ("tuned profile"), `hint` says how to fix it."""
    try:
        key = _stat_key(path)
    except OSError:
        return None
    if cache is not None:
        hit = cache.get(path)
        if hit is not None and hit[0] == key:
            return hit[1]
    problems: List[str]
    value = None
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except OSError:
        return None  # vanished or unreadable between stat and open: nothing to say about its content
    except ValueError as e:  # not JSON (or not UTF-8)
        problems = [f"not valid JSON ({e})"]
    else:
        try:
            value, problems = validate(obj)
        except Exception as e:  # noqa: BLE001 - a validator bug must not crash the caller either
            value, problems = None, [f"could not be checked ({e.__class__.__name__}: {e})"]
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        used = "ignoring the problems listed" if value is not None else "ignoring the file"
        log.warning("tiled attention: the %s %s is not usable as written (%s): %s.%s", what, path, used, shown,
                    f" {hint}" if hint else "")
    if cache is not None:
        cache[path] = (key, value)
    return value

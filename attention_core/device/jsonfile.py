"""JSON files on the user's disk as untrusted input: atomic writes, validated reads with one warning per bad file.

    atomic_write_json(path, obj)                 write to a unique temporary file in the same directory, then
                                                 os.replace: a reader sees the old file or the new one, never a
                                                 partial one, and concurrent writers never share a temporary name
    load_json_validated(path, validate, cache)   the parsed and validated content, or None (missing, unreadable,
                                                 not JSON, or rejected by `validate`); problems are logged as ONE
                                                 warning naming the file, once per version of the file
    read_json_validated(path, validate)          the same reading and checking, without logging or caching:
                                                 (key, value, problems), for callers that report problems
                                                 themselves (a command line's `error:` line)

`validate(obj) -> (value, problems)`: `value` is what the caller gets (None: nothing usable), `problems` a list of
short texts (an empty list: the file was fine). Nothing here raises for a bad file, whatever the path holds: any
bytes (not UTF-8, not JSON, JSON nested past Python's recursion limit, integers of more digits than Python
converts), a file larger than MAX_BYTES (never read past the limit), a folder, a FIFO or device (never opened for
a blocking read), a file without read permission. Each is one warning and None.
"""
from __future__ import annotations

import json
import logging
import os
import stat
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


MAX_BYTES = 8 << 20  # a profile or calibration is a few KB; 8 MB is a thousand times that, and no file
                     # larger is read into memory (a 2 GB file at this path costs one 8 MB read, then a warning)


def _key(st: os.stat_result):
    """What identifies a version of a file: a rewrite changes mtime, size or inode (atomic writes), a chmod the
    mode (so a file made readable again is re-read)."""
    return st.st_mtime_ns, st.st_size, st.st_ino, st.st_mode


def _read_capped(path: str):
    """(key, bytes or None, problem or None) of the regular file `path`, reading at most MAX_BYTES + 1 bytes;
    key None: there is no file (missing, or gone between stat and open), nothing to say. Never blocks: a FIFO
    or device at the path is reported, not opened for a blocking read."""
    try:
        st = os.stat(path)
    except OSError:
        return None, None, None
    if not stat.S_ISREG(st.st_mode):
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file (a pipe, socket or device)"
        return _key(st), None, f"{kind}, not a JSON file"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        return None, None, None  # vanished between stat and open
    except OSError as e:
        return _key(st), None, f"cannot be read ({e.strerror or e})"
    try:
        st = os.fstat(fd)  # what was opened: the path may have been replaced since the stat
        if not stat.S_ISREG(st.st_mode):
            return _key(st), None, "not a regular file (a pipe, socket or device), not a JSON file"
        if st.st_size > MAX_BYTES:
            return _key(st), None, (f"{st.st_size / 2**20:,.1f} MB, larger than the {MAX_BYTES >> 20} MB such a "
                                    "file can be; not read")
        chunks, left = [], MAX_BYTES + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > MAX_BYTES:  # grew while being read
            return _key(st), None, f"larger than the {MAX_BYTES >> 20} MB such a file can be; not read"
        return _key(st), data, None
    except OSError as e:
        return _key(st), None, f"cannot be read ({e.strerror or e})"
    finally:
        os.close(fd)


def read_json_validated(path: str, validate: Validator) -> Tuple[Any, Any, List[str]]:
    """(key, value, problems) of the JSON file `path`, without logging or caching: key None when there is no
    file (then value None, no problems); value None when nothing in it is usable; problems as `validate` gives
    them, or why the file could not be read or parsed. Never raises for any content of the file."""
    key, data, problem = _read_capped(path)
    if key is None:
        return None, None, []
    if problem is not None:
        return key, None, [problem]
    try:
        obj = json.loads(data.decode("utf-8"))
    except RecursionError:  # json's decoder recurses once per nesting level
        return key, None, ["nested deeper than Python's recursion limit, not a file this engine writes"]
    except ValueError as e:  # not JSON, not UTF-8, or an integer of more digits than Python converts
        return key, None, [f"not valid JSON ({_clip(str(e))})"]
    try:
        value, problems = validate(obj)
    except Exception as e:  # noqa: BLE001 - a validator bug (or a RecursionError on deep content) must not crash
        return key, None, [f"could not be checked ({e.__class__.__name__}: {_clip(str(e))})"]
    return key, value, list(problems)


def _clip(text: str, most: int = 200) -> str:
    return text if len(text) <= most else text[:most] + "..."


def load_json_validated(path: str, validate: Validator, cache: Optional[dict] = None, what: str = "file",
                        hint: str = "") -> Any:
    """The validated content of the JSON file `path`, or None. `cache` (a dict the caller owns) keeps the result
    per path until the file changes (mtime, size, inode or mode), so a bad file warns once, not on every call.
    `what` names the file in the warning ("tuned profile"), `hint` says how to fix it. Whatever the path holds
    (any bytes, a file too large, a folder, a FIFO, an unreadable file) the answer is a value or None and at most
    one warning per version of the file; a missing file is None without a warning."""
    if cache is not None:
        try:
            st = os.stat(path)
        except OSError:
            st = None
        hit = cache.get(path)
        if st is not None and hit is not None and hit[0] == _key(st):
            return hit[1]
    key, value, problems = read_json_validated(path, validate)
    if key is None:
        return None
    if problems:
        shown = "; ".join(_clip(p) for p in problems[:5]) + (
            f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        used = "ignoring the problems listed" if value is not None else "ignoring the file"
        log.warning("tiled attention: the %s %s is not usable as written (%s): %s.%s", what, path, used, shown,
                    f" {hint}" if hint else "")
    if cache is not None:
        cache[path] = (key, value)
    return value

"""Fixtures shared by the engine tests.

Nothing from attention_core is imported at this module's top: pytest loads conftest files before plugins start
(tools/mutation/mutate.py's coverage run among them), and a module imported here would have its import-time lines (the
constants) attributed to no test at all."""
import sys

import pytest


@pytest.fixture
def profdir(tmp_path, monkeypatch):
    """An empty per-user profile folder (tmp_path) as outside ComfyUI: no ComfyUI user folder, no
    TILED_ATTENTION_PROFILES / TILED_ATTENTION_LAYOUT switches, no cached profile before or after the test."""
    from attention_core.device import profiles
    monkeypatch.delitem(sys.modules, "folder_paths", raising=False)  # not inside ComfyUI
    monkeypatch.setenv(profiles.ENV_DIR, str(tmp_path))
    monkeypatch.delenv(profiles.ENV_SWITCH, raising=False)
    monkeypatch.delenv(profiles.ENV_LAYOUT, raising=False)
    profiles._cache.clear()
    yield tmp_path
    profiles._cache.clear()


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """Other processes' runnable threads as attention_core.device.machine_load reads them: none, in every engine test,
    so that `tune`, `calibrate` and `bench` save whatever else runs on the machine; the busy-machine refusals are tested
    with readings of their own (tests/engine/test_machine_load.py)."""
    from attention_core.device import machine_load
    monkeypatch.setattr(machine_load, "others_runnable", lambda pids=None, proc=None: 0)


@pytest.fixture
def unwritable_folder(monkeypatch):
    """make(path): a folder (created) in which nothing can be created, even by root, as on a read-only mount:
    tempfile.mkstemp and tempfile.mkdtemp refuse it with EACCES. Where the tests do not run as root, the folder
    is also made read-only for real (mode 555), which root's permission checks would ignore. Restored after."""
    import errno
    import os
    import tempfile
    folders = []

    def refusing(real):
        def make_in(*args, dir=None, **kwargs):
            if dir is not None and os.path.realpath(dir) in folders:
                raise PermissionError(errno.EACCES, "Permission denied", dir)
            return real(*args, dir=dir, **kwargs)
        return make_in
    monkeypatch.setattr(tempfile, "mkstemp", refusing(tempfile.mkstemp))
    monkeypatch.setattr(tempfile, "mkdtemp", refusing(tempfile.mkdtemp))

    def make(path):
        path.mkdir(parents=True, exist_ok=True)
        folders.append(os.path.realpath(str(path)))
        if os.geteuid() != 0:
            path.chmod(0o555)
        return path
    yield make
    for folder in folders:
        os.chmod(folder, 0o755)

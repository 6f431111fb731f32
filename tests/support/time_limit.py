"""pytest plugin: a time limit per test, so a test that hangs (an infinite loop, a lock that is never released)
fails instead of stopping the suite until CI's own limit.

Each test (setup, call and teardown together) gets TILED_ATTENTION_TEST_TIME_LIMIT seconds (default 900; 0 turns
the limit off). Past it, a watchdog thread writes the stacks of every thread to stderr and sends this process
SIGUSR2, whose handler raises TestTimeLimitExceeded in the main thread (a BaseException, so a test's `except
Exception` does not swallow it): that test fails, naming the limit, and the session goes on. Where that cannot
work (the main thread stuck in C code, or swallowing every exception), faulthandler ends the process with exit
status 1 a grace period later (min(60 s, the limit)), after writing the stacks again.
"""
import faulthandler
import os
import signal
import sys
import threading
import time

import pytest

ENV = "TILED_ATTENTION_TEST_TIME_LIMIT"
DEFAULT_S = 900.0
GRACE_S = 60.0


class TestTimeLimitExceeded(BaseException):
    """Raised in the main thread when a test runs past its time limit."""

    __test__ = False  # not a test class, whatever its name says


def limit_seconds(environ=None) -> float:
    """The per-test limit in seconds from TILED_ATTENTION_TEST_TIME_LIMIT (unset or empty: DEFAULT_S; 0: off)."""
    raw = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not raw:
        return DEFAULT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value >= 0 and value != float("inf")):
        raise pytest.UsageError(f"{ENV}={raw!r}: give the per-test time limit in seconds, a number >= 0 "
                                f"(0 turns it off; unset: {DEFAULT_S:.0f})")
    return value


class _Watchdog:
    """One daemon thread; arm() before each test, disarm() after it."""

    def __init__(self, seconds: float, stream):
        self.seconds = seconds
        self.stream = stream  # a duplicate of fd 2: pytest's capture does not hide it
        self._cond = threading.Condition()
        self._deadline = None
        self._nodeid = ""
        self.fired = None  # the test the watchdog signalled about, until the handler raises in it
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="test time limit", daemon=True)
        self._thread.start()

    def arm(self, nodeid: str):
        with self._cond:
            self._deadline, self._nodeid = time.monotonic() + self.seconds, nodeid
            self._cond.notify()
        faulthandler.dump_traceback_later(self.seconds + min(GRACE_S, self.seconds), exit=True, file=self.stream)

    def disarm(self):
        faulthandler.cancel_dump_traceback_later()
        with self._cond:
            self._deadline, self._nodeid = None, ""
            self._cond.notify()

    def take_fired(self) -> bool:
        """True once for a signal sent about the test still running (a late one, after it ended, is dropped)."""
        with self._cond:
            due = self.fired is not None and self.fired == self._nodeid
            self.fired = None
            return due

    def stop(self):
        self.disarm()
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(5)

    def _run(self):
        with self._cond:
            while not self._stopped:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                nodeid, self._deadline = self._nodeid, None
                self.fired = nodeid
                self.stream.write(f"\n{nodeid}: ran past the per-test time limit of {self.seconds:g} s ({ENV}); "
                                  f"the stacks of every thread follow\n")
                self.stream.flush()
                faulthandler.dump_traceback(file=self.stream, all_threads=True)
                os.kill(os.getpid(), signal.SIGUSR2)


def _expired(signum, frame):
    watchdog = _state.get("watchdog")
    if watchdog is None or not watchdog.take_fired():
        return
    raise TestTimeLimitExceeded(f"the test ran past the per-test time limit of {watchdog.seconds:g} s ({ENV}): "
                                f"it hangs, or it needs a higher {ENV} on this machine (0 turns the limit off)")


_state = {}


def pytest_configure(config):
    seconds = limit_seconds()
    usable = seconds > 0 and hasattr(signal, "SIGUSR2") and threading.current_thread() is threading.main_thread()
    if not usable or _state:
        return
    stream = os.fdopen(os.dup(sys.__stderr__.fileno()), "w", buffering=1)
    _state.update(stream=stream, previous=signal.signal(signal.SIGUSR2, _expired), watchdog=_Watchdog(seconds, stream))


def pytest_unconfigure(config):
    if not _state:
        return
    _state["watchdog"].stop()
    signal.signal(signal.SIGUSR2, _state["previous"])
    _state["stream"].close()
    _state.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    watchdog = _state.get("watchdog")
    if watchdog is not None:
        watchdog.arm(item.nodeid)
    try:
        yield
    finally:
        if watchdog is not None:
            watchdog.disarm()

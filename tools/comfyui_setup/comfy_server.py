"""A real ComfyUI server (either test version) in a subprocess, with this pack (and the tiny-model loader shim) in
its custom_nodes, a temporary base directory for models/input/output, and the /prompt + /history API.

pack_dir=None leaves the pack out (custom_nodes then holds only what the test puts there, e.g. a folder that
ComfyUI-Manager cloned); restart() stops and starts the same server (same port and base) and run_log() is the
log of the latest start only."""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from .comfyui import FRONTENDS, LATEST, ROOT, comfy_path

FIXTURES = os.path.join(ROOT, "tools", "fixtures")  # the test-only custom nodes (extra_custom_nodes)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ComfyServer:
    def __init__(self, base_dir, extra_custom_nodes=("tiny_model_loaders",), args=(), cpu=True, version=LATEST,
                 pack_dir=ROOT):
        self.version = version
        self.path = comfy_path(version)
        if self.path is None:
            raise RuntimeError(f"ComfyUI {version} is not set up (./dev setup)")
        self.base = str(base_dir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(self.base, "server.log")
        custom = os.path.join(self.base, "custom_nodes")
        os.makedirs(custom, exist_ok=True)
        os.makedirs(os.path.join(self.base, "models"), exist_ok=True)
        links = {n: os.path.join(FIXTURES, n) for n in extra_custom_nodes}
        if pack_dir is not None:
            links["tiled-attention"] = pack_dir
        for name, target in links.items():
            if not os.path.lexists(os.path.join(custom, name)):
                os.symlink(target, os.path.join(custom, name))
        self.args = (["--cpu"] if cpu else []) + list(args)
        frontend = FRONTENDS.get(version)
        if frontend and os.path.isdir(frontend) and "--front-end-root" not in self.args:
            self.args += ["--front-end-root", frontend]
        self.proc = None
        self._log_start = 0

    def start(self, timeout=240):
        cmd = [sys.executable, "main.py", "--base-directory", self.base, "--listen", "127.0.0.1",
               "--port", str(self.port), "--disable-auto-launch", "--database-url", "sqlite:///:memory:",
               *self.args]
        first = self.proc is None
        self._log = open(self.log_path, "w" if first else "a")
        self._log_start = 0 if first else self._log.tell()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, cwd=self.path, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        return self.wait_until_up(timeout)

    def wait_until_up(self, timeout=240):
        """Wait until the server answers /system_stats (after a start, or a restart the server did itself)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                self.get("/system_stats")
                return self
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.5)
        raise TimeoutError(f"ComfyUI did not answer within {timeout}s:\n{self.log()[-3000:]}")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if getattr(self, "_log", None):
            self._log.close()

    def restart(self, timeout=240):
        """Stop and start again with the same arguments; the log file keeps both runs."""
        self.stop()
        return self.start(timeout)

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def run_log(self):
        """The log written since the latest start()."""
        with open(self.log_path, "rb") as f:
            f.seek(self._log_start)
            return f.read().decode(errors="replace")

    def get(self, path):
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def post(self, path, payload):
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{path} answered {e.code}: {e.read().decode(errors='replace')[:3000]}") from e

    def run_prompt(self, prompt, timeout=600):
        """Queue an API-format prompt and wait for it; returns its history entry (outputs, status)."""
        return self.queue_prompt(prompt, timeout=timeout)[1]

    def queue_prompt(self, prompt, extra_data=None, timeout=600):
        """Queue an API-format prompt (with `extra_data`, as the frontend sends it) and wait for it; returns
        (prompt_id, history entry)."""
        pid = self.post("/prompt", {"prompt": prompt, "client_id": "tests",
                                    "extra_data": extra_data or {}})["prompt_id"]
        deadline = time.time() + timeout
        while time.time() < deadline:
            hist = self.get(f"/history/{pid}")
            if pid in hist and hist[pid].get("status", {}).get("completed") is not None:
                entry = hist[pid]
                if entry["status"].get("status_str") != "success":
                    msgs = json.dumps(entry["status"].get("messages", []))[-3000:]
                    raise RuntimeError(f"prompt failed: {msgs}\n--- server log ---\n{self.log()[-3000:]}")
                return pid, entry
            time.sleep(0.5)
        raise TimeoutError(f"prompt {pid} did not finish in {timeout}s\n{self.log()[-3000:]}")

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

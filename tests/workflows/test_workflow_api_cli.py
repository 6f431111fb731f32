"""tools/workflow_api.py as a command: every malformed input is one `error: ...` line and exit status 2, never a
traceback, and never a silently converted prompt."""
import http.server
import json
import os
import socket
import subprocess
import sys
import threading

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = os.path.join(ROOT, "tools", "workflow_api.py")

OBJECT_INFO = {
    "Source": {"input": {"required": {"value": ["INT", {"default": 1}]}}, "output": ["INT"]},
    "Sink": {"input": {"required": {"a": ["INT", {"forceInput": True}]}}, "output": []},
}


def node(nid, ntype, inputs=None, outputs=None, widgets=None, order=0, mode=0):
    return {"id": nid, "type": ntype, "order": order, "mode": mode, "inputs": inputs or [], "outputs": outputs or [],
            **({"widgets_values": widgets} if widgets is not None else {})}


def good_workflow():
    return {"nodes": [node(1, "Source", outputs=[{"name": "INT", "type": "INT", "links": [1]}], widgets=[5]),
                      node(2, "Sink", inputs=[{"name": "a", "type": "INT", "link": 1}], order=1)],
            "links": [[1, 1, 0, 2, 0, "INT"]]}


def reroute_chain(depth):
    wf = {"nodes": [node(1, "Source", outputs=[{"name": "INT", "type": "INT", "links": [1]}], widgets=[5])],
          "links": []}
    for i in range(depth):
        nid = 100 + i
        wf["nodes"].append(node(nid, "Reroute", inputs=[{"name": "", "type": "*", "link": i + 1}],
                                outputs=[{"name": "", "type": "*", "links": [i + 2]}]))
        origin = 1 if i == 0 else nid - 1
        wf["links"].append([i + 1, origin, 0, nid, 0, "*"])
    wf["nodes"].append(node(2, "Sink", inputs=[{"name": "a", "type": "INT", "link": depth + 1}], order=1))
    wf["links"].append([depth + 1, 100 + depth - 1, 0, 2, 0, "INT"])
    return wf


def run_cli(tmp_path, workflow_bytes=None, extra=(), workflow_path=None, object_info=True):
    if workflow_path is None:
        workflow_path = tmp_path / "wf.json"
        workflow_path.write_bytes(workflow_bytes)
    args = [sys.executable, CLI, str(workflow_path)]
    if object_info:
        oi = tmp_path / "object_info.json"
        oi.write_text(json.dumps(OBJECT_INFO))
        args += ["--object-info", str(oi)]
    return subprocess.run(args + list(extra), capture_output=True, text=True, timeout=60, cwd=str(tmp_path))


def assert_one_line_error(out, *words):
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    for w in words:
        assert w.lower() in lines[0].lower(), (w, lines[0])


def test_a_good_workflow_converts(tmp_path):
    out = run_cli(tmp_path, json.dumps(good_workflow()).encode())
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"1": {"inputs": {"value": 5}, "class_type": "Source",
                                            "_meta": {"title": "Source"}},
                                      "2": {"inputs": {"a": ["1", 0]}, "class_type": "Sink",
                                            "_meta": {"title": "Sink"}}}


def test_reroute_chains_thousands_deep_convert(tmp_path):
    out = run_cli(tmp_path, json.dumps(reroute_chain(5000)).encode())
    assert out.returncode == 0, out.stderr[-500:]
    assert json.loads(out.stdout)["2"]["inputs"]["a"] == ["1", 0]


def _bad(kind):
    wf = good_workflow()
    if kind == "origin_slot_null":
        wf["links"][0][2] = None
    elif kind == "order_unsortable":
        wf["nodes"][0]["order"] = "first"
    elif kind == "widgets_values_string":
        wf["nodes"][0]["widgets_values"] = "5"
    elif kind == "duplicate_node_ids":
        wf["nodes"][1]["id"] = 1
    elif kind == "nodes_not_list":
        wf["nodes"] = {"1": wf["nodes"][0]}
    elif kind == "link_not_int":
        wf["nodes"][1]["inputs"][0]["link"] = "1"
    elif kind == "top_level_list":
        wf = [wf]
    return json.dumps(wf).encode()


@pytest.mark.parametrize("kind,words", [
    ("empty", ["empty"]),
    ("whitespace", ["empty"]),
    ("malformed", ["not valid json", "line 1"]),
    ("bom", ["byte-order mark"]),
    ("nan", ["nan"]),
    ("infinity", ["infinity"]),
    ("latin1", ["not utf-8"]),
    ("origin_slot_null", ["origin_slot=none"]),
    ("order_unsortable", ["order", "first"]),
    ("widgets_values_string", ["widgets_values", "str"]),
    ("duplicate_node_ids", ["node id 1 appears twice"]),
    ("nodes_not_list", ["'nodes' must be a list"]),
    ("link_not_int", ["link '1'"]),
    ("top_level_list", ["must be a json object"]),
    ("duplicate_keys", ["appears twice"]),
])
def test_malformed_workflows_are_one_line_errors(tmp_path, kind, words):
    good = json.dumps(good_workflow())
    data = {"empty": b"", "whitespace": b"  \n", "malformed": b'{"nodes": [',
            "bom": b"\xef\xbb\xbf" + good.encode(),
            "nan": good.replace('"widgets_values": [5]', '"widgets_values": [NaN]').encode(),
            "infinity": good.replace('"widgets_values": [5]', '"widgets_values": [Infinity]').encode(),
            "latin1": good.replace('"order": 1', '"order": 1, "title": "caf\u00e9"').encode("latin-1"),
            "duplicate_keys": good.replace('"order": 0,', '"order": 0, "order": 1,', 1).encode()}.get(kind)
    out = run_cli(tmp_path, data if data is not None else _bad(kind))
    assert_one_line_error(out, *words)


def test_missing_path_and_directory(tmp_path):
    assert_one_line_error(run_cli(tmp_path, workflow_path=tmp_path / "nope.json"), "does not exist", "nope.json")
    assert_one_line_error(run_cli(tmp_path, workflow_path=tmp_path), "is a directory")
    wf = tmp_path / "wf.json"
    wf.write_text(json.dumps(good_workflow()))
    out = subprocess.run([sys.executable, CLI, str(wf), "--object-info", str(tmp_path / "missing_oi.json")],
                         capture_output=True, text=True, timeout=60)
    assert_one_line_error(out, "object_info", "does not exist")


def test_output_into_a_directory(tmp_path):
    out = run_cli(tmp_path, json.dumps(good_workflow()).encode(), extra=["-o", str(tmp_path)])
    assert out.returncode == 2 and out.stderr.startswith("error: cannot write") and "Traceback" not in out.stderr


def _serve(answer_object_info, answer_prompt=b"{}"):
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, body, code=200):
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._send(answer_object_info)

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            code, body = answer_prompt if isinstance(answer_prompt, tuple) else (200, answer_prompt)
            self._send(body, code)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.mark.parametrize("case", ["html_object_info", "empty_object_info", "object_info_list", "html_prompt_reply",
                                  "prompt_rejected"])
def test_bad_server_replies_are_one_line_errors(tmp_path, case):
    oi = json.dumps(OBJECT_INFO).encode()
    answers = {"html_object_info": (b"<html>oops</html>", b"{}"), "empty_object_info": (b"", b"{}"),
               "object_info_list": (b"[]", b"{}"), "html_prompt_reply": (oi, b"<html>502</html>"),
               "prompt_rejected": (oi, (400, b'{"error": {"type": "prompt_outputs_failed_validation",\n "x": 1}}'))}
    server, url = _serve(*answers[case])
    try:
        out = run_cli(tmp_path, json.dumps(good_workflow()).encode(), object_info=False,
                      extra=["--server", url, "--queue"])
    finally:
        server.shutdown()
        server.server_close()
    assert_one_line_error(out, {"html_object_info": "not valid json", "empty_object_info": "empty",
                                "object_info_list": "must be a json object", "html_prompt_reply": "not valid json",
                                "prompt_rejected": "answered 400"}[case])
    assert url in out.stderr or case == "object_info_list"


def test_connection_refused_names_the_url(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    url = f"http://127.0.0.1:{port}"
    out = run_cli(tmp_path, json.dumps(good_workflow()).encode(), object_info=False, extra=["--server", url])
    assert_one_line_error(out, "cannot reach", f"127.0.0.1:{port}/object_info")

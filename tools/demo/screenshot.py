"""Refresh the README's screenshot: a bundled workflow in the real ComfyUI frontend (a stock server of the chosen
version with this pack, the frontend that version pins), headless Chromium, the view fitted to the graph.

    python -m tools.demo.screenshot [--workflow "Wan 2.2 5B Text to Video 480p"] [--version 0.33.0] \
        [--out docs/screenshot-wan22-480p.png]

Needs /usr/bin/chromium with a CJK font (apt-get install chromium fonts-wqy-microhei: the Wan prompts hold
Chinese text) and the playwright package. The tests never write this file; run this by hand and commit it."""
import argparse
import json
import os
import shutil
import sys
import tempfile
import urllib.request

from ..comfyui_setup.comfy_server import ComfyServer
from ..comfyui_setup.comfyui import LATEST, ROOT, VERSIONS, comfy_path
from .frontend_page import (CHROMIUM, INIT_SCRIPT, JS_FIT, JS_FULL_DETAIL, JS_READY, LAUNCH_FLAGS, VIEWPORT,
                            pinned_frontend, settings, workflow_path, write_placeholders)

DEFAULT_OUT = os.path.join(ROOT, "docs", "screenshot-wan22-480p.png")


def take(workflow, version, out):
    from playwright.sync_api import sync_playwright

    comfy = comfy_path(version)
    if comfy is None:
        raise SystemExit(f"ComfyUI {version} is not set up: run ./dev setup")
    path = workflow_path(workflow)
    with open(path, encoding="utf-8") as f:
        graph = json.load(f)
    base = tempfile.mkdtemp(prefix="comfy-screenshot-")
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    write_placeholders(base, [path])
    try:
        with ComfyServer(base, version=version, extra_custom_nodes=()) as srv:
            req = urllib.request.Request(srv.url + "/settings", data=json.dumps(settings(pinned_frontend(comfy)))
                                         .encode(), method="POST", headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=30).close()
            with sync_playwright() as pw:
                ctx = pw.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True,
                                                            args=LAUNCH_FLAGS, viewport=VIEWPORT)
                ctx.add_init_script(INIT_SCRIPT)
                pg = ctx.pages[0] if ctx.pages else ctx.new_page()
                pg.goto(srv.url + "/", wait_until="load", timeout=90_000)
                pg.wait_for_function(JS_READY, timeout=90_000, polling=200)
                pg.evaluate(JS_FULL_DETAIL)
                pg.evaluate("([g, name]) => app.loadGraphData(g, true, true, name)", [graph, workflow])
                pg.wait_for_function(f"() => app.graph._nodes.length === {len(graph['nodes'])}", timeout=60_000)
                pg.wait_for_timeout(1000)
                pg.evaluate(JS_FIT)
                pg.wait_for_timeout(500)
                os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
                pg.screenshot(path=out)
                ctx.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(profile, ignore_errors=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workflow", default="Wan 2.2 5B Text to Video 480p", help="a workflows/*.json name without .json")
    p.add_argument("--version", default=LATEST, choices=VERSIONS, help="the ComfyUI that serves the page")
    p.add_argument("--out", default=DEFAULT_OUT, help="the PNG to write (default: the README's screenshot)")
    args = p.parse_args(argv)
    print(take(args.workflow, args.version, args.out))


if __name__ == "__main__":
    sys.exit(main())

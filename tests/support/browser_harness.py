"""What the three browser test files share: a stock ComfyUI server of one version with this pack alone, the
frontend that version pins and its first-run popups off; a headless Chromium (Debian's) under playwright with the
stock templates' pictures not fetched; and loading the app until it is up. Missing pieces (no Chromium, no
playwright, no ComfyUI or frontend set up) skip through comfy_harness.missing, which fails under CI=true."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import urllib.request

from comfy_harness import missing
from tools.comfyui_setup.comfyui import FRONTENDS, comfy_path
from tools.comfyui_setup.comfy_server import ComfyServer
from tools.demo.frontend_page import CHROMIUM, JS_FULL_DETAIL, JS_READY, LAUNCH_FLAGS, pinned_frontend, settings

# the stock templates' pictures: hundreds of requests, none of them what is tested
STOCK_THUMBNAILS = [f"**/templates/*.{ext}" for ext in ("webp", "png", "jpg", "jpeg", "gif", "mp4", "webm", "mp3")]
UI_TIMEOUT_MS = 60_000  # any one step in the page (a dialog opening, a click landing), generous for 2 busy cores


def require_browser():
    """Skip (fail under CI) without an executable Chromium or a usable playwright package."""
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        missing(f"no Chromium at {CHROMIUM} (apt-get install chromium fonts-wqy-microhei, or set CHROMIUM_PATH); "
                "./dev test installs Debian's package when run as root")
    try:
        import playwright.sync_api  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import problem means: no browser tests here
        missing(f"the playwright Python package is unusable here: {e!r}")


def post_json(url, payload) -> int:
    """POST payload as JSON; the HTTP status."""
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status


def load_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def start_server(version: str, base, prepare=None) -> ComfyServer:
    """A started stock ComfyUI `version` in folder `base` with this pack and no other custom node, its pinned
    frontend (`srv.frontend`) and that frontend's first-run popups off. `prepare(srv)` runs before the start (files
    the test needs in the server's folders). Stop it with srv.stop()."""
    require_browser()
    comfy = comfy_path(version)
    if comfy is None:
        missing(f"no ComfyUI {version}: run the suite with ./dev test (it sets up the stock ComfyUIs)")
    frontend = pinned_frontend(comfy)
    if version in FRONTENDS and not os.path.isdir(FRONTENDS[version]):
        missing(f"no frontend {frontend} for ComfyUI {version} at {FRONTENDS[version]}: run ./dev setup")
    srv = ComfyServer(base, version=version, extra_custom_nodes=())
    if prepare is not None:
        prepare(srv)
    srv.start()
    srv.frontend = frontend
    assert post_json(srv.url + "/settings", settings(frontend)) == 200
    return srv


@contextlib.contextmanager
def chromium(viewport: dict, init_script: str, console_log: str):
    """(context, page): a headless Chromium with a fresh profile, `init_script` in every document, the stock
    templates' pictures aborted, and the page's console and errors collected in page.console (written to
    `console_log` when the block ends). Everything is closed and removed afterwards."""
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    console = []
    try:
        pw = sync_playwright().start()
    except Exception as e:  # noqa: BLE001
        shutil.rmtree(profile, ignore_errors=True)
        missing(f"playwright could not start its driver: {e!r}")
    try:
        ctx = pw.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, headless=True, args=LAUNCH_FLAGS, viewport=viewport, timeout=60_000)
    except PlaywrightError as e:
        pw.stop()
        shutil.rmtree(profile, ignore_errors=True)
        missing(f"Chromium at {CHROMIUM} would not start under playwright: {str(e)[:800]}")
    try:
        ctx.add_init_script(init_script)
        for pattern in STOCK_THUMBNAILS:  # matched by the driver: other requests never wait on Python
            ctx.route(pattern, lambda route: route.abort())
        pg = ctx.pages[0] if ctx.pages else ctx.new_page()
        pg.on("console", lambda m: console.append(f"[{m.type}] {m.text}"))
        pg.on("pageerror", lambda e: console.append(f"[pageerror] {e}"))
        pg.console = console
        yield ctx, pg
    finally:
        os.makedirs(os.path.dirname(console_log), exist_ok=True)
        with open(console_log, "w") as f:
            f.write("\n".join(console))
        ctx.close()
        pw.stop()
        shutil.rmtree(profile, ignore_errors=True)


def load_app(pg, url: str, failure_png: str):
    """Load the frontend from `url` and wait until it is up (then the node library in full detail); on a timeout a
    screenshot goes to `failure_png` and an AssertionError carries the console's last lines."""
    from playwright.sync_api import Error as PlaywrightError

    pg.goto(url + "/", wait_until="load", timeout=90_000)
    try:
        pg.wait_for_function(JS_READY, timeout=90_000, polling=200)
    except PlaywrightError:
        pg.screenshot(path=failure_png)
        raise AssertionError("the ComfyUI frontend did not come up:\n" + "\n".join(pg.console[-40:]))
    pg.evaluate(JS_FULL_DETAIL)

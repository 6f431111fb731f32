"""The real ComfyUI frontend in headless Chromium (Debian's package, driven by the playwright Python package):
launch flags, the settings that keep first-run popups away, the page-side checks and view fitting, and the
placeholder files that let a server list every model and image a workflow loads. Shared by the browser test
and tools/demo/screenshot.py."""
import json
import os

from ..comfyui_setup.comfyui import ROOT

CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
LAUNCH_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1920, "height": 1080}
MODEL_FOLDERS = ("checkpoints", "diffusion_models", "text_encoders", "vae", "loras", "latent_upscale_models")
MODEL_EXTENSIONS = (".safetensors", ".ckpt", ".pt", ".pth", ".gguf")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")
# the frontend's first-run flows and popups, off before the page loads (setting ids of frontends 1.32.9 and
# 1.49.6); settings(frontend_version) adds Comfy.InstalledVersion
SETTINGS = {
    "Comfy.TutorialCompleted": True,            # else the first load opens the templates dialog
    "Comfy.Notification.ShowVersionUpdates": False,
    "Comfy.Release.Status": "skipped",
    "Comfy.Minimap.Visible": False,             # keeps the screenshots to the graph
    "Comfy.Graph.CanvasInfo": False,
    "Comfy.Workflow.WorkflowTabsPosition": "Sidebar",  # no row of a dozen tabs over the screenshots
    "Comfy.Workflow.ShowMissingNodesWarning": True,  # the missing-nodes report stays on
}
INIT_SCRIPT = "localStorage.setItem('vueNodesBannerDismissed', 'true')"  # the Nodes 2.0 banner

# the app is up and this pack's nodes are registered
JS_READY = """() => !!(window.app && window.app.graph && window.app.canvas && window.app.extensionManager
    && window.LiteGraph && window.LiteGraph.registered_node_types['TiledAttentionPatch']
    && document.querySelector('#graph-canvas'))"""

# full-detail node drawing at any zoom, for readable screenshots (the frontend resets this setting when it
# starts, so it is set after, through its own settings API)
JS_FULL_DETAIL = "() => app.extensionManager.setting.set('LiteGraph.Canvas.MinFontSizeForLOD', 0)"

# the view fitted to the graph right of the side bar and below the floating toolbar: its full width, and the
# height of its nodes and groups (a tall note may run off the bottom)
JS_FIT = """() => {
    const c = app.canvas, el = c.canvas, left = 70, top = 80, pad = 25;
    const rects = app.graph._nodes.map(n => [n.type, n.boundingRect])
        .concat((app.graph._groups || []).map(g => ['group', g._bounding || g.boundingRect]));
    const tall = rects.filter(([t]) => !/Note$/.test(t)).map(([, b]) => b), all = rects.map(([, b]) => b);
    const x0 = Math.min(...all.map(b => b[0])), x1 = Math.max(...all.map(b => b[0] + b[2]));
    const y0 = Math.min(...tall.map(b => b[1])), y1 = Math.max(...tall.map(b => b[1] + b[3]));
    const w = el.clientWidth - left, h = el.clientHeight - top;
    const scale = Math.min((w - 2 * pad) / (x1 - x0), (h - 2 * pad) / (y1 - y0), 1);
    c.ds.scale = scale;
    c.ds.offset[0] = left / scale + (w / scale - (x1 - x0)) / 2 - x0;
    c.ds.offset[1] = (top + pad) / scale - y0;
    c.setDirty(true, true);
    c.draw(true, true);
    return scale;
}"""


def settings(frontend_version):
    return dict(SETTINGS, **{"Comfy.InstalledVersion": frontend_version})


def pinned_frontend(comfy):
    """The comfyui-frontend-package version that a ComfyUI folder's requirements.txt pins, or None."""
    with open(os.path.join(comfy, "requirements.txt")) as f:
        for line in f:
            name, _, pin = line.strip().partition("==")
            if name.strip().lower().replace("_", "-") == "comfyui-frontend-package":
                return pin.strip()
    return None


def write_placeholders(base, workflow_paths):
    """Empty files under every model file name the workflows' widgets name (in each model folder of a
    --base-directory) and a small image under each LoadImage file name (in its input/), so the server lists
    them and the frontend reports no missing model or image."""
    models, images = set(), set()
    for path in workflow_paths:
        with open(path, encoding="utf-8") as f:
            workflow = json.load(f)
        for node in workflow["nodes"]:
            for value in node.get("widgets_values") or []:
                if not isinstance(value, str):
                    continue
                if value.endswith(MODEL_EXTENSIONS):
                    models.add(value)
                elif node["type"] == "LoadImage" and value.lower().endswith(IMAGE_EXTENSIONS):
                    images.add(value)
    for folder in MODEL_FOLDERS:
        os.makedirs(os.path.join(base, "models", folder), exist_ok=True)
        for name in models:
            open(os.path.join(base, "models", folder, name), "wb").close()
    os.makedirs(os.path.join(base, "input"), exist_ok=True)
    from PIL import Image
    for name in images:
        Image.new("RGB", (64, 64), (90, 120, 200)).save(os.path.join(base, "input", name))


def workflow_path(name):
    """workflows/<name>.json; an old name from before the workflows were named as the Templates browser shows
    them (wan22_5b_t2v_480p) gives the renamed file."""
    from ..workflow_api import renamed_workflow
    path = os.path.join(ROOT, "workflows", name + ".json")
    return renamed_workflow(path) or path

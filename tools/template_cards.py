"""The picture ComfyUI's Templates browser shows for each bundled workflow: workflows/<name>.jpg beside
workflows/<name>.json (the frontend asks the server for /api/workflow_templates/<pack folder>/<name>.jpg; the
pack's workflows/ folder is served there). Drawn from the workflow's own data (tools/workflow_facts.py): model,
task, output size, frames, duration, frame rate, audio and sampling stages, and that it runs with tiled
attention; so a card cannot drift from its workflow.

    python -m tools.template_cards            # (re)write workflows/*.jpg
    python -m tools.template_cards --out DIR  # write them elsewhere (what the test compares)
    python -m tools.template_cards --check    # exit 1 if a committed card differs from its workflow's

Each card is a 512x512 baseline JPEG (quality 90, no chroma subsampling, so text stays crisp), drawn with the
DejaVu fonts matplotlib ships (a pinned file in the venv: the same pixels on every machine with the pinned
Pillow). The frontend shows it about 224 px wide, so nothing on it is smaller than 26 px.
"""
import argparse
import glob
import importlib.util
import json
import os
import sys

from PIL import Image, ImageChops, ImageDraw, ImageFont

from .comfyui_setup.comfyui import ROOT
from .workflow_facts import template_title, workflow_facts

WORKFLOW_DIR = os.path.join(ROOT, "workflows")
SIZE = 512
MARGIN = 36
TOP_FREE = 76
JPEG_OPTIONS = {"quality": 90, "subsampling": 0, "optimize": False, "progressive": False}
PIXEL_TOLERANCE = 8  # JPEG encoders of different libjpeg builds round differently by a few levels; text changes by 100s
# per model family: background gradient top/bottom and accent colour
PALETTES = {
    "Wan 2.2": ((24, 32, 74), (70, 30, 96), (120, 190, 255)),
    "LTX-2.3": ((10, 52, 58), (44, 28, 20), (255, 176, 72)),
    "Z-Image Turbo": ((52, 20, 40), (16, 24, 60), (255, 120, 160)),
}
WHITE, SOFT = (246, 246, 250), (200, 204, 220)


def _font_dir():
    spec = importlib.util.find_spec("matplotlib")  # located, not imported
    if spec is None or not spec.origin:
        raise RuntimeError("tools.template_cards draws with the DejaVu fonts matplotlib ships: install matplotlib "
                           "(tests/requirements-test.txt pins it)")
    return os.path.join(os.path.dirname(spec.origin), "mpl-data", "fonts", "ttf")


def _font(name, size):
    return ImageFont.truetype(os.path.join(_font_dir(), name), size)


def _palette(facts):
    for family, palette in PALETTES.items():
        if facts.model.startswith(family):
            return palette
    raise ValueError(f"no card colours for {facts.model!r}: add them to PALETTES in {__name__}")


def _fit(draw, text, font_name, size, width):
    """The largest font size <= size at which text fits in width pixels."""
    while size > 26 and draw.textlength(text, font=_font(font_name, size)) > width:
        size -= 2
    return _font(font_name, size)


def _tile_icon(draw, x, y, cell, accent):
    """A 4x4 grid of score tiles, the ones computed lit: the picture of attention done tile by tile."""
    for row in range(4):
        for col in range(4):
            lit = col <= row + 1
            box = (x + col * cell, y + row * cell, x + (col + 1) * cell - 4, y + (row + 1) * cell - 4)
            draw.rectangle(box, fill=accent if lit else (255, 255, 255, 40))


def _seconds(facts):
    return f"{facts.seconds:.1f} s"


def draw_card(facts):
    """The card of one workflow's facts as a PIL RGB image of SIZE x SIZE."""
    top, bottom, accent = _palette(facts)
    img = Image.new("RGB", (SIZE, SIZE))
    draw = ImageDraw.Draw(img, "RGBA")
    for y in range(SIZE):
        t = y / (SIZE - 1)
        draw.line([(0, y), (SIZE, y)], fill=tuple(round(a + (b - a) * t) for a, b in zip(top, bottom)))
    width = SIZE - 2 * MARGIN
    # the top TOP_FREE pixels stay plain: frontend 1.49 lays its "Node graph" badge over a card's top left
    y = TOP_FREE
    draw.text((MARGIN, y), facts.model_long, font=_fit(draw, facts.model_long, "DejaVuSans-Bold.ttf", 44, width),
              fill=WHITE)
    y += 56
    source, _, target = facts.task.partition(" to ")
    task = f"{source} \u2192 {target}" + (" + Audio" if facts.audio else "")
    draw.text((MARGIN, y), task, font=_fit(draw, task, "DejaVuSans.ttf", 38, width), fill=accent)
    y += 60
    size = f"{facts.width}\u00d7{facts.height}"
    draw.text((MARGIN, y), size, font=_fit(draw, size, "DejaVuSans-Bold.ttf", 88, width), fill=WHITE)
    y += 104
    length = "one image" if facts.image else f"{facts.frames} frames \u00b7 {_seconds(facts)} \u00b7 {facts.fps:g} fps"
    draw.text((MARGIN, y), length, font=_fit(draw, length, "DejaVuSans.ttf", 32, width), fill=SOFT)
    if facts.experts > 1:
        y += 42
        experts = f"{facts.experts} experts: high \u2192 low noise"
        draw.text((MARGIN, y), experts, font=_fit(draw, experts, "DejaVuSans.ttf", 28, width), fill=SOFT)
    elif facts.stages > 1:
        y += 42
        stages = f"{facts.stages} stages" + (f", \u00d7{facts.upscale:g} latent upscale" if facts.upscale != 1 else "")
        draw.text((MARGIN, y), stages, font=_fit(draw, stages, "DejaVuSans.ttf", 28, width), fill=SOFT)
    # the band at the bottom: this pack's part
    band = SIZE - 118
    draw.rectangle((0, band, SIZE, SIZE), fill=(0, 0, 0, 110))
    draw.rectangle((0, band, SIZE, band + 4), fill=accent)
    cell = 20
    _tile_icon(draw, MARGIN, band + 22, cell, accent)
    text_x = MARGIN + 4 * cell + 22
    draw.text((text_x, band + 18), "Tiled attention",
              font=_fit(draw, "Tiled attention", "DejaVuSans-Bold.ttf", 38, SIZE - MARGIN - text_x), fill=WHITE)
    draw.text((text_x, band + 66), "exact \u00b7 O(N) memory",
              font=_fit(draw, "exact \u00b7 O(N) memory", "DejaVuSans.ttf", 30, SIZE - MARGIN - text_x), fill=SOFT)
    return img


def card_name(workflow_path):
    """workflows/<name>.json -> <name>.jpg, the file name the frontend requests."""
    return os.path.splitext(os.path.basename(workflow_path))[0] + ".jpg"


def workflow_paths(workflow_dir=WORKFLOW_DIR):
    """The workflows ComfyUI lists as this pack's templates: the .json files directly in workflows/."""
    return sorted(glob.glob(os.path.join(workflow_dir, "*.json")))


def load_facts(path):
    with open(path, encoding="utf-8") as f:
        return workflow_facts(json.load(f))


def write_cards(out_dir, workflow_dir=WORKFLOW_DIR):
    """Draw every workflow's card into out_dir; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for path in workflow_paths(workflow_dir):
        target = os.path.join(out_dir, card_name(path))
        draw_card(load_facts(path)).save(target, "JPEG", **JPEG_OPTIONS)
        written.append(target)
    return written


def misnamed(workflow_dir=WORKFLOW_DIR):
    """(file, the name its facts give) for each workflow whose file name is not its title."""
    out = []
    for path in workflow_paths(workflow_dir):
        want = template_title(load_facts(path)) + ".json"
        if os.path.basename(path) != want:
            out.append((os.path.basename(path), want))
    return out


def differing(drawn_dir, committed_dir=WORKFLOW_DIR):
    """What differs between freshly drawn cards and the committed ones, one line each: a workflow without a
    committed card, a card without a workflow, a different size, or a pixel off by more than PIXEL_TOLERANCE."""
    drawn = {os.path.basename(p) for p in glob.glob(os.path.join(drawn_dir, "*.jpg"))}
    committed = {os.path.basename(p) for p in glob.glob(os.path.join(committed_dir, "*.jpg"))}
    problems = [f"{name}: no committed card (run python -m tools.template_cards)" for name in sorted(drawn - committed)]
    problems += [f"{name}: a card without a workflow beside it" for name in sorted(committed - drawn)]
    for name in sorted(drawn & committed):
        with Image.open(os.path.join(drawn_dir, name)) as a, Image.open(os.path.join(committed_dir, name)) as b:
            if a.size != b.size or a.mode != b.mode:
                problems.append(f"{name}: {b.size} {b.mode} committed, {a.size} {a.mode} drawn")
                continue
            diff = ImageChops.difference(a.convert("RGB"), b.convert("RGB"))
            worst = max(hi for _lo, hi in diff.getextrema())
            if worst > PIXEL_TOLERANCE:
                off = sum(diff.convert("L").point(lambda v: 255 if v > PIXEL_TOLERANCE else 0).histogram()[255:])
                problems.append(f"{name}: differs from what its workflow gives ({off} pixels, up to {worst} levels); "
                                "run python -m tools.template_cards")
    return problems


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", metavar="DIR", default=WORKFLOW_DIR, help="where to write the cards (default: workflows/)")
    p.add_argument("--check", action="store_true",
                   help="draw into a temporary folder and compare with workflows/*.jpg instead of writing")
    args = p.parse_args(argv)
    if args.check:
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            write_cards(tmp)
            problems = differing(tmp, WORKFLOW_DIR)
        for line in problems:
            print(line, file=sys.stderr)
        return 1 if problems else 0
    for path in write_cards(args.out):
        print(os.path.relpath(path, os.getcwd()))
    for have, want in misnamed():
        print(f"warning: {have} describes {want!r}: rename it (the Templates browser shows the file name)",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

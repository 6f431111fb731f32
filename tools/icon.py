"""The pack's icon for the Comfy Registry and ComfyUI-Manager (pyproject.toml's [tool.comfy] Icon): docs/icon.png,
a 400x400 PNG. It shows what the pack does: an attention score matrix computed tile by tile, the tiles of one query
row lit across the keys, the next rows fading in. Drawn with Pillow's rectangles alone (no font), so the same
pixels come out on every machine.

    python -m tools.icon            # (re)write docs/icon.png
    python -m tools.icon --check    # exit 1 if docs/icon.png is not what this script draws
"""
import argparse
import os
import sys

from PIL import Image, ImageChops, ImageDraw

from .comfyui_setup.comfyui import ROOT

ICON = os.path.join(ROOT, "docs", "icon.png")
SIZE = 400
GRID = 6                                          # 6 x 6 score tiles
TOP, BOTTOM = (24, 32, 74), (70, 30, 96)          # the Wan cards' background (tools/template_cards.py)
ACCENT, CURRENT = (120, 190, 255), (255, 176, 72)     # lit tiles; the tile being computed (the LTX cards' accent)


def _mix(a, b, t):
    return tuple(round(x + (y - x) * t) for x, y in zip(a, b))


def draw_icon() -> Image.Image:
    """The icon as an RGB image, SIZE x SIZE."""
    img = Image.new("RGB", (SIZE, SIZE))
    draw = ImageDraw.Draw(img)
    for y in range(SIZE):  # vertical gradient
        draw.line([(0, y), (SIZE, y)], fill=_mix(TOP, BOTTOM, y / (SIZE - 1)))
    margin, gap = 44, 8
    cell = (SIZE - 2 * margin - (GRID - 1) * gap) // GRID
    done_rows, current = 3, 4  # rows 0-2 computed, row 3 under way up to its 5th tile
    for row in range(GRID):
        for col in range(GRID):
            x = margin + col * (cell + gap)
            y = margin + row * (cell + gap)
            if row < done_rows:
                fill = _mix(ACCENT, TOP, 0.12 * (done_rows - 1 - row))
            elif row == done_rows and col < current:
                fill = ACCENT
            elif row == done_rows and col == current:
                fill = CURRENT
            else:
                fill = _mix(TOP, (255, 255, 255), 0.14)
            draw.rounded_rectangle((x, y, x + cell, y + cell), radius=8, fill=fill)
    return img


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.icon", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only compare with docs/icon.png; exit 1 if it differs")
    args = ap.parse_args(argv)
    img = draw_icon()
    if args.check:
        try:
            with Image.open(ICON) as committed:
                same = committed.size == img.size and not ImageChops.difference(committed.convert("RGB"),
                                                                                 img).getbbox()
        except OSError:
            same = False
        if not same:
            print("docs/icon.png differs from what tools/icon.py draws: run python -m tools.icon", file=sys.stderr)
            return 1
        return 0
    img.save(ICON, format="PNG", optimize=False)
    print(f"wrote {os.path.relpath(ICON, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The embedded image + text task: synthetic 32 x 32 images of 1 to 3 squares of one colour on black, and the
question "What is in the image?" answered "<count> <colour>" (e.g. "2 red"). Colour and count are read from the
pixels only, so the loss falls below what the text alone allows (log 12 nats over the answers) only as the vision
tower, the connector and the language model learn together.

    splits = make_shapes(seed=42)            # {"train": [row, ...], "eval": [...]}: TRL's images + messages rows
    row = splits["train"][0]                 # {"images": [PIL.Image], "messages": [user, assistant]}
"""

from __future__ import annotations

import random

COLOURS = {"red": (230, 40, 40), "green": (40, 200, 60), "blue": (50, 80, 240), "yellow": (235, 220, 40)}
SIZE, CELL = 32, 16  # four 16 x 16 cells; a square of 8..12 pixels inside one
QUESTION = "What is in the image?"


def shape_image(count: int, colour: str, rng: random.Random):
    """An RGB image of `count` squares in distinct cells."""
    from PIL import Image, ImageDraw  # noqa: PLC0415  (pillow: only for image rows)

    img = Image.new("RGB", (SIZE, SIZE), (0, 0, 0))
    draw = ImageDraw.Draw(img)
    for cell in rng.sample(range(4), count):
        side = rng.randint(8, 12)
        x0 = (cell % 2) * CELL + rng.randint(0, CELL - side)
        y0 = (cell // 2) * CELL + rng.randint(0, CELL - side)
        draw.rectangle([x0, y0, x0 + side - 1, y0 + side - 1], fill=COLOURS[colour])
    return img


def shape_row(rng: random.Random) -> dict:
    count, colour = rng.randint(1, 3), rng.choice(sorted(COLOURS))
    return {
        "images": [shape_image(count, colour, rng)],
        "messages": [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": f"{count} {colour}"},
        ],
    }


def make_shapes(seed: int = 42, n_train: int = 2048, n_eval: int = 64) -> dict[str, list[dict]]:
    rng = random.Random(seed)
    return {"train": [shape_row(rng) for _ in range(n_train)], "eval": [shape_row(rng) for _ in range(n_eval)]}

"""The images of a vision-language row: PIL images, file paths or bytes (TRL's `images` / `image` columns), checked
once before training and opened again when a batch needs them.

    srcs = row_images(row, index)                     # the row's image references, as given
    checked = [check_image(s, index, j, root) for j, s in enumerate(srcs)]   # one line naming the example if bad
    img = open_image(checked[0])                      # an RGB PIL image

A path is resolved inside `root`, the directory the user named as the dataset (or the directory of the file they
named): hfpar treats user files as untrusted, so a path that leaves it (`..`, an absolute path elsewhere, a symbolic
link out of it) is refused, as is any path when the rows came from no local directory (the hub, a generator).
"""

from __future__ import annotations

import io
from pathlib import Path

from .errors import DataError, _one_line


def row_images(row: dict, index: int) -> list:
    """The image references of a row: its `images` list, its single `image`, or none."""
    if "images" in row and row["images"] is not None:
        imgs = row["images"]
        if not isinstance(imgs, (list, tuple)):
            raise DataError(f"example {index}: 'images' holds a {type(imgs).__name__}, expected a list of images")
        return list(imgs)
    if row.get("image") is not None:
        return [row["image"]]
    return []


def _describe(src) -> str:
    if isinstance(src, str):
        return repr(src if len(src) < 80 else src[:77] + "...")
    if isinstance(src, (bytes, bytearray)):
        return f"{len(src)} bytes"
    return type(src).__name__


def check_image(src, index: int, j: int, root: Path | None):
    """A reference open_image can open again: a PIL image, bytes, or a resolved path inside root. Opens it once
    (decoding every pixel), so a file that cannot be read fails here, naming the example and the image."""
    from PIL import Image  # noqa: PLC0415  (pillow: only for image rows)

    if isinstance(src, dict):  # datasets' Image feature, undecoded: {"bytes": ..., "path": ...}
        src = src.get("bytes") or src.get("path")
    named = _describe(src)  # as the row gives it
    if isinstance(src, str):
        src = _confined(src, index, j, root)
    elif not isinstance(src, (bytes, bytearray, Image.Image)):
        raise DataError(
            f"example {index}: image {j} is a {type(src).__name__}; expected a PIL image, a file path or bytes"
        )
    try:
        open_image(src)
    except Exception as exc:  # noqa: BLE001  (an untrusted file: whatever PIL raises is one line)
        raise DataError(
            f"example {index}: image {j} ({named}) cannot be opened: {type(exc).__name__}: {_one_line(exc)}"
        ) from None
    return src


def _confined(name: str, index: int, j: int, root: Path | None) -> Path:
    if root is None:
        raise DataError(
            f"example {index}: image {j} is the path {name!r}, but the dataset was not read from a local directory; "
            "image paths are resolved inside the dataset's directory only (give the images as bytes, or a local "
            "dataset directory holding them)"
        )
    base = root.resolve()
    path = (base / name).resolve()  # symbolic links followed: one pointing out of the directory is refused
    if not path.is_relative_to(base):
        raise DataError(
            f"example {index}: image {j} path {name!r} lies outside the dataset's directory {base}; hfpar reads "
            "images inside the directory you named only"
        )
    if not path.is_file():
        raise DataError(f"example {index}: image {j} path {name!r}: no such file in {base}")
    return path


def open_image(src):
    """An RGB PIL image, its pixels decoded, from what check_image returned."""
    from PIL import Image  # noqa: PLC0415

    if isinstance(src, Image.Image):
        img = src
    elif isinstance(src, (bytes, bytearray)):
        img = Image.open(io.BytesIO(src))
    else:
        img = Image.open(src)
    img.load()
    return img if img.mode == "RGB" else img.convert("RGB")

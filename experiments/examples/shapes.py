"""Images for the vision examples, made here instead of downloaded: small RGB pictures of a filled circle, a
square or a triangle (the class, 0-2) at a random place, size and colour on a noisy background, stored as PNG
bytes in a Parquet ``binary`` column, as a dataset of encoded images would be. ``decode`` is the
``data.transform`` that turns a batch of them into tensors, with a random crop and flip when training.

    python experiments/examples/shapes.py --out /tmp/shapes.parquet --rows 2048
"""

from __future__ import annotations

import argparse
import io

import numpy as np

CLASSES = ("circle", "square", "triangle")


def draw(rng: np.random.Generator, size: int) -> tuple[bytes, int]:
    """One picture, PNG-encoded, and its class."""
    from PIL import Image, ImageDraw

    label = int(rng.integers(len(CLASSES)))
    background = rng.integers(0, 80, size=(size, size, 3), dtype=np.uint8)
    image = Image.fromarray(background)
    r = rng.uniform(size * 0.2, size * 0.4)
    cx, cy = rng.uniform(r, size - r, size=2)
    colour = tuple(int(c) for c in rng.integers(120, 256, size=3))
    pen = ImageDraw.Draw(image)
    if label == 0:
        pen.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour)
    elif label == 1:
        pen.rectangle([cx - r, cy - r, cx + r, cy + r], fill=colour)
    else:
        pen.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue(), label


def write_shapes(path: str, rows: int, size: int = 16, seed: int = 0) -> str:
    """``rows`` pictures of ``size`` x ``size`` pixels into a Parquet file: columns ``image`` (PNG bytes) and
    ``label`` (0-2)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    pictures = [draw(rng, size) for _ in range(rows)]
    pq.write_table(pa.table({"image": pa.array([p for p, _ in pictures], type=pa.binary()),
                             "label": pa.array([label for _, label in pictures], type=pa.int64())}), path)
    return path


MEAN, STD = 0.3, 0.3
"""What ``decode`` normalises the pixels with (scaled to [0, 1] first)."""


def decode(columns: dict, seeds: np.ndarray, training: bool):
    """data.transform: PNG bytes (column ``image``) -> (N, 3, H, W) float32, normalised; ``label`` as the
    targets. Training rows are shifted by up to 2 pixels (a crop of the picture padded by reflection) and
    flipped left to right at random, each by a generator of its own seed: every layout sees the same pixels."""
    from PIL import Image

    images = np.stack([np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in columns["image"]])
    x = (images.astype(np.float32) / 255.0 - MEAN) / STD  # (N, H, W, 3)
    if training:
        x = np.stack([_augment(picture, np.random.default_rng(int(seed))) for picture, seed in zip(x, seeds)])
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2)), columns["label"]


def _augment(picture: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    h, w, _ = picture.shape
    padded = np.pad(picture, ((2, 2), (2, 2), (0, 0)), mode="reflect")
    dy, dx = rng.integers(0, 5, size=2)
    crop = padded[dy:dy + h, dx:dx + w]
    return crop[:, ::-1] if rng.random() < 0.5 else crop


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_shapes(args.out, args.rows, args.size, args.seed))

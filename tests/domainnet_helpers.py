"""A small DomainNet in the official layout (tests/test_domainnet.py, tests/test_mobilenet.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

DOMAINS = ["clipart", "infograph", "painting", "quickdraw", "real", "sketch"]
CLASSES = ["zebra", "ant", "eel", "bee", "dog", "cat"]  # written in this order, not sorted
MEAN = (0.485, 0.456, 0.406)  # FL-bench's constants for "domain" (ImageNet's)
STD = (0.229, 0.224, 0.225)


def count(d: int, c: int) -> int:
    """Images of class c in domain d: 3..8, so that fractions and residuals vary."""
    return 3 + (2 * d + 3 * c) % 6


def write_domainnet(home: Path) -> None:
    """The official layout: <domain>/<class>/<domain>_<class no>_<image no>.jpg of varying
    sizes, and <domain>_train.txt / <domain>_test.txt (every third image is a test image)."""
    from PIL import Image  # the tests that call this skip without Pillow

    rng = np.random.default_rng(0)
    for d, domain in enumerate(DOMAINS):
        lines = {"train": [], "test": []}
        for c, cls in enumerate(CLASSES):
            folder = home / domain / cls
            folder.mkdir(parents=True, exist_ok=True)
            for k in reversed(range(count(d, c))):  # creation order is not name order
                name = f"{domain}_{c:03d}_{k:06d}.jpg"
                img = rng.integers(0, 256, (6 + k, 9 + d, 3), dtype=np.uint8)
                Image.fromarray(img).save(folder / name, format="JPEG", quality=95)
                lines["test" if k % 3 == 2 else "train"].append(f"{domain}/{cls}/{name} {c}")
        for part, rows in lines.items():
            (home / f"{domain}_{part}.txt").write_text("\n".join(sorted(rows)) + "\n")

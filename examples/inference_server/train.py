"""Train the digits MLP once and save it as ``aiotinyrt/data/digits_mlp.npz``.

    pip install scikit-learn numpy && python examples/inference_server/train.py

scikit-learn's 8x8 digits (``sklearn.datasets.load_digits``, shipped inside the package: nothing
is downloaded) are split 80/20 (stratified, seed 0). An ``MLPClassifier`` with three hidden ReLU
layers of 64 learns on pixels scaled to 0..1. The file holds, as float32:

* ``w0..w3`` (``n_in x n_out``, row-major) and ``b0..b3``: the four dense layers;
* ``input_scale``: what raw pixels (0..16) are multiplied by before the first layer (1/16);

and, as uint8, the held-out set (``test_images``: 360 x 64 raw pixels, ``test_labels``), so the
served path's accuracy can be measured without scikit-learn. The file is a plain ``.npz``, read
by numpy or, without numpy, by :func:`mlp.read_npz`. It lives in the package so that
``python -m aiotinyrt demo`` finds it after ``pip install .``; the server loads the same file.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "aiotinyrt" / "data" / "digits_mlp.npz"
HIDDEN = (64, 64, 64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    images, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.2, random_state=args.seed, stratify=labels
    )
    scale = 1.0 / 16.0
    start = time.perf_counter()
    clf = MLPClassifier(hidden_layer_sizes=HIDDEN, max_iter=500, random_state=args.seed)
    clf.fit(x_train * scale, y_train)
    print(f"trained {HIDDEN} in {time.perf_counter() - start:.1f} s ({clf.n_iter_} epochs)")
    print(f"scikit-learn held-out accuracy: {clf.score(x_test * scale, y_test):.4f} on {len(y_test)} images")

    arrays: dict[str, np.ndarray] = {"input_scale": np.array([scale], dtype=np.float32)}
    for i, (w, b) in enumerate(zip(clf.coefs_, clf.intercepts_, strict=True)):
        arrays[f"w{i}"] = np.ascontiguousarray(w, dtype=np.float32)
        arrays[f"b{i}"] = np.ascontiguousarray(b, dtype=np.float32)
    arrays["test_images"] = x_test.astype(np.uint8)
    arrays["test_labels"] = y_test.astype(np.uint8)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **arrays)  # type: ignore[arg-type]
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()

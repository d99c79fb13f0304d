"""Train the digits CNN through tinygrad on the AIO device and write ``aiotinyrt/data/digits_cnn.npz``.

    pip install -e ".[tinygrad,train]" && python examples/tinygrad_digits/train.py

scikit-learn's 8x8 digits (``load_digits``, shipped inside scikit-learn: nothing is downloaded)
are split 80/20 (stratified, seed 0). tinygrad's Adam and backward pass train the model; every
kernel runs on aiotinyrt (``import aiotinyrt.tinygrad``, device ``AIO``), the training step is a
TinyJit, so after two steps each step is one aiotinyrt graph replay. The file holds the weights
(float32) and the held-out images and labels (uint8).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from model import WEIGHTS, DigitsCNN, accuracy, train
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import aiotinyrt.tinygrad  # noqa: F401  (registers the AIO device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=WEIGHTS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--device", default="AIO")
    args = parser.parse_args()

    images, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.2, random_state=args.seed, stratify=labels
    )
    model = DigitsCNN.init(args.device, args.seed)
    start = time.perf_counter()
    losses = train(model, x_train, y_train, args.steps, args.batch, args.lr, args.seed)
    took = time.perf_counter() - start
    print(f"{args.steps} steps in {took:.1f} s: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    acc = accuracy(model, x_test, y_test)
    print(f"held-out accuracy: {acc:.4f} on {len(y_test)} images")
    arrays = model.arrays()
    arrays["test_images"] = x_test.astype(np.uint8)
    arrays["test_labels"] = y_test.astype(np.uint8)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **arrays)  # type: ignore[arg-type]
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()

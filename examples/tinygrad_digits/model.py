"""A small tinygrad CNN for scikit-learn's 8x8 digits, and its weights file.

``conv 3x3 (1 -> 8) + ReLU -> conv 3x3 (8 -> 16) + ReLU -> 2x2 max-pool -> dense 256 -> 10``:
about 4,000 parameters. Inputs are raw pixels (0..16, 64 per image); the model scales them.
The weights live in the package (``aiotinyrt/data/digits_cnn.npz``) with the held-out images
and labels the training script did not train on, so the served accuracy can be checked
without scikit-learn.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tinygrad import Context, Tensor, TinyJit, nn

WEIGHTS = Path(__file__).resolve().parents[2] / "aiotinyrt" / "data" / "digits_cnn.npz"
SHAPES = {
    "c1_w": (8, 1, 3, 3),
    "c1_b": (8,),
    "c2_w": (16, 8, 3, 3),
    "c2_b": (16,),
    "fc_w": (10, 16 * 4 * 4),
    "fc_b": (10,),
}
#: fan-in of each parameter's layer (for the uniform initialisation, as torch's default)
FAN_IN = {"c1": 9, "c2": 72, "fc": 256}


class DigitsCNN:
    """The model's parameters on one tinygrad device and its forward pass."""

    def __init__(self, params: dict[str, Tensor]) -> None:
        self.params = params

    @classmethod
    def init(cls, device: str, seed: int = 0) -> DigitsCNN:
        """Random initial weights (uniform in +-1/sqrt(fan_in)), reproducible by ``seed``."""
        rng = np.random.default_rng(seed)
        arrays = {}
        for name, shape in SHAPES.items():
            bound = 1 / np.sqrt(FAN_IN[name[:2]])
            arrays[name] = rng.uniform(-bound, bound, shape).astype(np.float32)
        return cls.from_arrays(arrays, device)

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], device: str) -> DigitsCNN:
        params = {
            name: Tensor(np.ascontiguousarray(arrays[name], np.float32), device=device) for name in SHAPES
        }
        return cls({name: t.contiguous().realize() for name, t in params.items()})

    @classmethod
    def load(cls, device: str, path: Path = WEIGHTS) -> DigitsCNN:
        """The shipped (trained) weights."""
        with np.load(path) as data:
            return cls.from_arrays({name: data[name] for name in SHAPES}, device)

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: t.numpy() for name, t in self.params.items()}

    def __call__(self, pixels: Tensor) -> Tensor:
        """Logits ``(N, 10)`` of raw pixels ``(N, 64)``."""
        p = self.params
        x = (pixels.reshape(-1, 1, 8, 8) / 16.0).conv2d(p["c1_w"], p["c1_b"], padding=1).relu()
        x = x.conv2d(p["c2_w"], p["c2_b"], padding=1).relu().max_pool2d((2, 2))
        return x.flatten(1).linear(p["fc_w"].T, p["fc_b"])


def held_out(path: Path = WEIGHTS) -> tuple[np.ndarray, np.ndarray]:
    """The held-out images (uint8, ``N x 64``) and labels shipped with the weights."""
    with np.load(path) as data:
        return data["test_images"], data["test_labels"]


def train(
    model: DigitsCNN, images: np.ndarray, labels: np.ndarray, steps: int, batch: int, lr: float, seed: int = 0
) -> list[float]:
    """``steps`` Adam steps on random batches; returns the loss of every step."""
    device = model.params["fc_w"].device
    x_all = Tensor(images.astype(np.float32), device=device).realize()
    y_all = Tensor(labels.astype(np.int32), device=device).realize()
    opt = nn.optim.Adam(list(model.params.values()), lr=lr)
    Tensor.manual_seed(seed)

    @TinyJit
    def step() -> Tensor:
        opt.zero_grad()
        idx = Tensor.randint(batch, high=x_all.shape[0], device=device)
        loss = model(x_all[idx]).sparse_categorical_crossentropy(y_all[idx]).backward()
        return loss.realize(*opt.schedule_step())

    with Context(TRAINING=1):
        return [float(step().item()) for _ in range(steps)]


def accuracy(model: DigitsCNN, images: np.ndarray, labels: np.ndarray) -> float:
    device = model.params["fc_w"].device
    logits = model(Tensor(images.astype(np.float32), device=device)).numpy()
    return float((logits.argmax(axis=1) == labels).mean())

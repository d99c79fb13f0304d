"""The digits MLP's kernels and weights file, shared by the demo (:mod:`aiotinyrt.demo`) and
``examples/inference_server/mlp.py``.

The weights and held-out images live in ``aiotinyrt/data/digits_mlp.npz`` (package data, trained by
``examples/inference_server/train.py``); :func:`weights_path` names the installed file and
:func:`read_npz` reads it without numpy.
"""

from __future__ import annotations

import ast
import math
import sys
import zipfile
from array import array
from importlib import resources
from pathlib import Path
from typing import Any

# The kernels of the digits MLP, shared with examples/inference_server/mlp.py (which imports them):
# raw C in tinygrad's convention, weights packed once on the device in blocks of 16 outputs.
KERNELS = r"""
#include <math.h>
typedef float f8 __attribute__((vector_size(32), aligned(4)));

static void dense(float* restrict out, const float* restrict x, const float* restrict w,
                  const float* restrict b, int rows, int n_in, int n_out, int relu) {
  for (int o0 = 0; o0 < n_out; o0 += 16) {
    const float* restrict wt = w + (long)o0 * n_in;
    int no = n_out - o0 < 16 ? n_out - o0 : 16;
    float bias[16] = {0};
    for (int o = 0; o < no; o++) bias[o] = b[o0 + o];
    int r0 = 0;
    for (; r0 + 6 <= rows; r0 += 6) {
      f8 b0 = *(const f8*)bias, b1 = *(const f8*)(bias + 8);
      f8 a[6][2] = {{b0, b1}, {b0, b1}, {b0, b1}, {b0, b1}, {b0, b1}, {b0, b1}};
      const float* restrict xr = x + (long)r0 * n_in;
      for (int k = 0; k < n_in; k++) {
        f8 w0 = *(const f8*)(wt + 16 * k), w1 = *(const f8*)(wt + 16 * k + 8);
        for (int r = 0; r < 6; r++) {
          float v = xr[(long)r * n_in + k];
          a[r][0] += v * w0;
          a[r][1] += v * w1;
        }
      }
      for (int r = 0; r < 6; r++) {
        float* dst = out + (long)(r0 + r) * n_out + o0;
        for (int o = 0; o < no; o++) {
          float v = o < 8 ? a[r][0][o] : a[r][1][o - 8];
          dst[o] = relu && v < 0.0f ? 0.0f : v;
        }
      }
    }
    for (; r0 < rows; r0++) {
      f8 a0 = *(const f8*)bias, a1 = *(const f8*)(bias + 8);
      const float* restrict xr = x + (long)r0 * n_in;
      for (int k = 0; k < n_in; k++) {
        a0 += xr[k] * *(const f8*)(wt + 16 * k);
        a1 += xr[k] * *(const f8*)(wt + 16 * k + 8);
      }
      float* dst = out + (long)r0 * n_out + o0;
      for (int o = 0; o < no; o++) {
        float v = o < 8 ? a0[o] : a1[o - 8];
        dst[o] = relu && v < 0.0f ? 0.0f : v;
      }
    }
  }
}

/* out = relu(x @ w + b) for `rows` rows */
void dense_relu(float* restrict out, const float* restrict x, const float* restrict w,
                const float* restrict b, int rows, int n_in, int n_out) {
  dense(out, x, w, b, rows, n_in, n_out, 1);
}

/* probs = softmax(x @ w + b) per row, classes = argmax */
void dense_softmax(float* restrict probs, int* restrict classes, const float* restrict x,
                   const float* restrict w, const float* restrict b, int rows, int n_in, int n_out) {
  dense(probs, x, w, b, rows, n_in, n_out, 0);
  for (int r = 0; r < rows; r++) {
    float* p = probs + (long)r * n_out;
    int best = 0;
    for (int o = 1; o < n_out; o++) if (p[o] > p[best]) best = o;
    float top = p[best], sum = 0.0f;
    for (int o = 0; o < n_out; o++) { p[o] = expf(p[o] - top); sum += p[o]; }
    for (int o = 0; o < n_out; o++) p[o] /= sum;
    classes[r] = best;
  }
}

/* row-major w[n_in][n_out] -> packed (see dense) */
void pack_dense(float* restrict packed, const float* restrict w, int n_in, int n_out) {
  int padded = (n_out + 15) / 16 * 16;
  for (int o0 = 0; o0 < padded; o0 += 16)
    for (int k = 0; k < n_in; k++)
      for (int j = 0; j < 16; j++)
        packed[(long)o0 * n_in + k * 16 + j] = o0 + j < n_out ? w[(long)k * n_out + o0 + j] : 0.0f;
}

static unsigned mix32(unsigned x) {
  x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16;
  return x;
}

/* random packed weights, He-uniform (limit sqrt(6 / n_in), for ReLU layers), and zero bias */
void init_dense(float* restrict packed, float* restrict b, int n_in, int n_out, int seed) {
  int padded = (n_out + 15) / 16 * 16;
  float limit = sqrtf(6.0f / (float)n_in);
  for (int o0 = 0; o0 < padded; o0 += 16)
    for (int k = 0; k < n_in; k++)
      for (int j = 0; j < 16; j++) {
        unsigned h = mix32((unsigned)seed * 0x9e3779b9U ^ mix32((unsigned)(k * n_out + o0 + j)));
        float u = (float)(h >> 8) * (1.0f / 16777216.0f);
        packed[(long)o0 * n_in + k * 16 + j] = o0 + j < n_out ? (2.0f * u - 1.0f) * limit : 0.0f;
      }
  for (int o = 0; o < n_out; o++) b[o] = 0.0f;
}
"""

_NPY_TYPECODES = {"<f4": "f", "<f8": "d", "|u1": "B", "<u1": "B", "|i1": "b", "<i4": "i", "<i8": "q"}


def read_npz(path: Any) -> dict[str, tuple[array[Any], tuple[int, ...]]]:
    """Read a ``.npz`` (as written by ``numpy.savez``/``savez_compressed``) without numpy.

    Returns ``name -> (array, shape)``; only C-ordered arrays of the dtypes in ``_NPY_TYPECODES``.
    """
    out: dict[str, tuple[array[Any], tuple[int, ...]]] = {}
    with zipfile.ZipFile(path) as zf:
        for member in zf.namelist():
            data = zf.read(member)
            if data[:6] != b"\x93NUMPY":
                raise ValueError(f"{path}: {member} is not a .npy array")
            major = data[6]
            if major == 1:
                header_len, start = int.from_bytes(data[8:10], "little"), 10
            else:
                header_len, start = int.from_bytes(data[8:12], "little"), 12
            header = ast.literal_eval(data[start : start + header_len].decode("latin1"))
            if header["fortran_order"]:
                raise ValueError(f"{path}: {member} is Fortran-ordered")
            typecode = _NPY_TYPECODES.get(header["descr"])
            if typecode is None:
                raise ValueError(f"{path}: {member} has unsupported dtype {header['descr']}")
            values = array(typecode)
            values.frombytes(data[start + header_len :])
            if sys.byteorder == "big" and values.itemsize > 1:
                values.byteswap()
            shape = tuple(header["shape"])
            if len(values) != math.prod(shape):
                raise ValueError(f"{path}: {member} has {len(values)} values for shape {shape}")
            out[member.removesuffix(".npy")] = (values, shape)
    return out


def weights_path() -> Path:
    """Where the installed package keeps ``digits_mlp.npz`` (the path a user would open)."""
    with resources.as_file(resources.files("aiotinyrt") / "data" / "digits_mlp.npz") as file:
        return Path(file).resolve()

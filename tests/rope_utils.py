"""A numpy RoPE written from the formulas (inverse frequencies by loop, pairs
by index): the oracle of the RoPE and RoPE + append tests."""

from __future__ import annotations

import math

import numpy as np

import pkvattn


def np_inv_freq(head_dim, theta, rotary_dim=None, scaling=None):
  rot = head_dim if rotary_dim is None else rotary_dim
  inv = np.array([1.0 / theta ** (2 * i / rot) for i in range(rot // 2)])
  if isinstance(scaling, pkvattn.LinearRopeScaling):
    return inv / scaling.factor
  if isinstance(scaling, pkvattn.Llama3RopeScaling):
    out = []
    old = scaling.original_max_position_embeddings
    for f in inv:
      wavelen = 2 * math.pi / f
      if wavelen < old / scaling.high_freq_factor:
        out.append(f)
      elif wavelen > old / scaling.low_freq_factor:
        out.append(f / scaling.factor)
      else:
        smooth = (old / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        out.append((1 - smooth) * f / scaling.factor + smooth * f)
    return np.array(out)
  return inv


def np_rope(x, positions, inv, style):
  """x [T, H, D] float64; pairs (i, i + half) or (2i, 2i + 1)."""
  x = np.asarray(x, np.float64)
  out = x.copy()
  half = len(inv)
  for t, p in enumerate(positions):
    for i in range(half):
      a, b = (i, i + half) if style == "neox" else (2 * i, 2 * i + 1)
      c, s = math.cos(p * inv[i]), math.sin(p * inv[i])
      out[t, :, a] = x[t, :, a] * c - x[t, :, b] * s
      out[t, :, b] = x[t, :, b] * c + x[t, :, a] * s
  return out

"""FP8 sensitivity probe: per matmul site and recipe, how much signal survives in outputs and gradients.

On a few real batches the model runs once in high precision while every Dense site records its input x
and, through a zero "tap" added to its output, the gradient g = dL/dy of the training loss. For each
site and recipe the three GEMMs of training are then recomputed with the recipe (gem_jax/precision/
fp8.py, emulated) and compared with the same GEMMs in bf16:

  SNR_dB = 10 log10( sum ref^2 / sum (recipe - ref)^2 )      for y = x w, dx = g w^T, dw = x^T g

summed over the batches. bf16's own SNR against float32 is reported next to it for scale. A site is
safe for a recipe when the smallest of its three SNRs clears the threshold; `propose` picks, per site,
the first safe recipe in order of preference and bf16 where none is safe, and returns the rules of a
PrecisionConfig that encodes it. Nothing here changes the model: recipes are restored after capture.

Letters: M rows of a site (tokens or examples), K its input width, N its output width.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from gem_jax.model.heads import multitask_loss
from gem_jax.precision import fp8, policy

PROBED = ("mxfp8", "mxfp8_rceil", "mxfp8_e5m2", "rowwise", "tensorwise")
PREFERENCE = ("mxfp8", "mxfp8_rceil", "rowwise", "tensorwise")
QUANTITIES = ("y", "dx", "dw")


@dataclasses.dataclass
class SiteCapture:
  site: str
  w_KxN: np.ndarray
  xs_MxK: list    # one per batch
  gs_MxN: list


def capture(model, batches, spec) -> dict[str, SiteCapture]:
  """Inputs and output gradients of every Dense site over `batches`, with the model in high precision.

  One jitted function per batch shape returns both: the forward records every site's input, and the
  gradient of the loss w.r.t. zero taps on the site outputs is each site's g."""
  from flax import nnx

  sites = policy.dense_sites(model)
  saved = {site: dense.recipe for site, dense in sites}
  widths = {site: dense.out_features for site, dense in sites}
  out = {site: SiteCapture(site, np.asarray(dense.kernel[...], np.float32), [], []) for site, dense in sites}
  try:
    for _, dense in sites:
      dense.recipe = None
    graphdef, state = nnx.split(model)
  finally:
    for site, dense in sites:
      dense.recipe = saved[site]

  def loss_of(taps, state, batch):
    with policy.probing({}, taps):
      return multitask_loss(nnx.merge(graphdef, state)(batch), batch, spec)[0]

  @jax.jit
  def inputs_and_grads(state, batch):
    inputs = {}
    with policy.probing(inputs):
      nnx.merge(graphdef, state)(batch)
    taps = {site: jnp.zeros(x.shape[:-1] + (widths[site],), jnp.float32) for site, x in inputs.items()}
    return inputs, jax.grad(loss_of)(taps, state, batch)

  for batch in batches:
    inputs, grads = inputs_and_grads(state, batch)
    for site, x in inputs.items():
      out[site].xs_MxK.append(np.asarray(x, np.float32).reshape(-1, x.shape[-1]))
      out[site].gs_MxN.append(np.asarray(grads[site], np.float32).reshape(-1, widths[site]))
  return {s: c for s, c in out.items() if c.xs_MxK}


@functools.partial(jax.jit, static_argnums=3)
def _energies(x_MxK, w_KxN, g_MxN, recipes: tuple[str, ...]):
  """{recipe: 3 x 2 [signal, noise] energies of (y, dx, dw)}: bf16 against float32, the others against
  bf16 (one compiled program per site shape)."""
  hi = jax.lax.Precision.HIGHEST

  def gemms(recipe):
    if recipe == "f32":
      return (jnp.dot(x_MxK, w_KxN, precision=hi), jnp.dot(g_MxN, w_KxN.T, precision=hi),
              jnp.dot(x_MxK.T, g_MxN, precision=hi))
    y, pullback = jax.vjp(lambda a, b: fp8.matmul(a, b, recipe, "emulate"), x_MxK, w_KxN)
    return (y,) + pullback(g_MxN)

  def energy(got, base):
    return jnp.stack([jnp.stack([jnp.sum(jnp.square(b)), jnp.sum(jnp.square(a - b))]) for a, b in zip(got, base)])

  exact, ref = gemms("f32"), gemms("bf16")
  out = {"bf16": energy(ref, exact)}
  for r in recipes:
    out[r] = energy(gemms(r), ref)
  return out


def snr_db(signal: float, noise: float) -> float:
  if noise == 0:
    return math.inf
  if signal == 0 or not math.isfinite(noise):
    return -math.inf
  return 10.0 * math.log10(signal / noise)


def measure(captures: dict[str, SiteCapture], recipes=PROBED) -> list[dict]:
  """One row per site: shape, and SNR (dB) of y, dx, dw for each recipe against bf16 (and bf16 against
  float32 under "bf16")."""
  rows = []
  for site, cap in sorted(captures.items()):
    energy = {}
    for x, g in zip(cap.xs_MxK, cap.gs_MxN):
      for r, e in _energies(x, cap.w_KxN, g, tuple(recipes)).items():
        energy[r] = energy.get(r, 0.0) + np.asarray(e, np.float64)
    m = sum(x.shape[0] for x in cap.xs_MxK)
    row = {"site": site, "rows": m, "k": cap.w_KxN.shape[0], "n": cap.w_KxN.shape[1], "snr_db": {}}
    for r, e in energy.items():
      row["snr_db"][r] = {q: snr_db(*e[i]) for i, q in enumerate(QUANTITIES)}
    rows.append(row)
  return rows


def propose(rows: list[dict], threshold_db: float, preference=PREFERENCE) -> dict[str, str]:
  """{site: recipe}: the first recipe in `preference` whose worst SNR (y, dx, dw) is >= threshold_db,
  else "bf16"."""
  chosen = {}
  for row in rows:
    pick = "bf16"
    for r in preference:
      if r in row["snr_db"] and min(row["snr_db"][r].values()) >= threshold_db:
        pick = r
        break
    chosen[row["site"]] = pick
  return chosen


def as_rules(chosen: dict[str, str]) -> tuple[str, ...]:
  """PrecisionConfig rules (exact site names) for a proposal; use them with policy="bf16"."""
  return tuple(f"{site}={recipe}" for site, recipe in sorted(chosen.items()))


def table(rows: list[dict], chosen: dict[str, str] | None = None) -> str:
  """The probe's console table: worst-of-three SNR per recipe, with y/dx/dw for MXFP8."""
  recipes = [r for r in rows[0]["snr_db"] if r != "bf16"] if rows else []
  head = f"{'site':<28} {'M':>6} {'K':>5} {'N':>5} | {'bf16/f32':>8} " + " ".join(f"{r:>11}" for r in recipes)
  head += "  mxfp8 y/dx/dw" + ("   proposed" if chosen else "")
  lines = [head, "-" * len(head)]
  for row in rows:
    s = row["snr_db"]
    worst = lambda r: min(s[r].values())
    line = (f"{row['site']:<28} {row['rows']:>6} {row['k']:>5} {row['n']:>5} | {worst('bf16'):>8.1f} "
            + " ".join(f"{worst(r):>11.1f}" for r in recipes))
    if "mxfp8" in s:
      line += "  " + "/".join(f"{s['mxfp8'][q]:.1f}" for q in QUANTITIES)
    if chosen:
      line += f"   {chosen[row['site']]}"
    lines.append(line)
  return "\n".join(lines)

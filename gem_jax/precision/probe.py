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
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from gem_jax.precision import fp8, policy

PROBED = ("mxfp8", "mxfp8_rceil", "mxfp8_e5m2", "rowwise", "tensorwise")
# Round-up MX scales first: the same cost as floor scales and a higher SNR at every site measured so far.
PREFERENCE = ("mxfp8_rceil", "mxfp8", "rowwise", "tensorwise")
QUANTITIES = ("y", "dx", "dw")


@dataclasses.dataclass
class SiteCapture:
  site: str
  w_KxN: np.ndarray
  xs_MxK: list    # one per batch
  gs_MxN: list


def capture(model, sites, batches, loss_fn) -> dict[str, SiteCapture]:
  """Inputs and output gradients of every Dense site over `batches`, with the model in high precision.

  sites: the model's (site, Dense) pairs (gem_jax/model/layers.py dense_sites); loss_fn(model, batch) ->
  the scalar training loss (the task's). One jitted function per batch shape returns both: the forward
  records every site's input, and the gradient of the loss w.r.t. zero taps on the site outputs is each
  site's g. The sites run in the compute dtype throughout (the probe's recipe override)."""
  from flax import nnx

  widths = {site: dense.out_features for site, dense in sites}
  out = {site: SiteCapture(site, np.asarray(dense.kernel[...], np.float32), [], []) for site, dense in sites}
  high = {site: None for site, _ in sites}
  graphdef, state = nnx.split(model)

  def loss_of(taps, state, batch):
    with policy.probing({}, taps, recipes=high):
      return loss_fn(nnx.merge(graphdef, state), batch)

  @jax.jit
  def inputs_and_grads(state, batch):
    inputs = {}
    with policy.probing(inputs, recipes=high):
      loss_fn(nnx.merge(graphdef, state), batch)
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


def end_to_end(model, sites, batches, loss_fn, recipe: str = "mxfp8_rceil", base: str = "bf16",
               sets: dict | None = None, singles: bool | Iterable[str] = True) -> dict:
  """Whole-model gradient SNR (dB, all parameters, summed over batches) against the model with every
  site in `base`, when only one site at a time runs `recipe` ("sites"), when every site does ("all"),
  and for each named set of sites in `sets`. `singles` may name the sites to measure one at a time.
  sites and loss_fn as for `capture`.

  The per-site SNRs of `measure` are local: errors that a site adds to dx travel down the backward chain
  and compound, so a site early in the model or feeding many parameters can cost far more than its own
  SNR says. For scale, "sgd_noise_snr_db" is the SNR of one batch's gradient against the mean over the
  batches (>= 2 batches): the noise SGD already lives with. One program is compiled; sites are
  switched at run time (policy.probing's swap).
  """
  from flax import nnx

  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  every_site_base = {site: base for site, _ in sites}

  def switched_loss(params, batch, select):
    with policy.probing({}, None, swap=(recipe, select), recipes=every_site_base):
      return loss_fn(nnx.merge(graphdef, params, rest), batch)

  grad_fn = jax.jit(jax.value_and_grad(switched_loss))
  names = [site for site, _ in sites]
  off = {site: jnp.zeros((), bool) for site in names}
  flat = lambda grads: np.concatenate([np.asarray(g, np.float64).ravel() for g in jax.tree_util.tree_leaves(grads)])
  baseline = [(float(loss), flat(grads)) for loss, grads in (grad_fn(params, b, off) for b in batches)]

  def compare(chosen) -> dict:
    select = {site: jnp.asarray(site in chosen) for site in names}
    signal = noise = loss_delta = 0.0
    for batch, (loss0, g0) in zip(batches, baseline):
      loss, grads = grad_fn(params, batch, select)
      g = flat(grads)
      signal += float(g0 @ g0)
      noise += float((g - g0) @ (g - g0))
      loss_delta += abs(float(loss) - loss0) / max(abs(loss0), 1e-30)
    return {"grad_snr_db": snr_db(signal, noise), "loss_rel_delta": loss_delta / len(batches)}

  out = {"recipe": recipe, "base": base, "sites": {}, "sets": {}}
  if singles:
    wanted = names if singles is True else [site for site in names if site in set(singles)]
    out["sites"] = {site: compare({site}) for site in wanted}
  out["all"] = compare(set(names))
  for name, chosen in (sets or {}).items():
    unknown = set(chosen) - set(names)
    if unknown:
      raise ValueError(f"end_to_end: sets[{name!r}] names unknown sites {sorted(unknown)}")
    out["sets"][name] = compare(set(chosen))
  if len(batches) >= 2:
    grads = np.stack([g for _, g in baseline])
    mean = grads.mean(0)
    spread = float(np.sum((grads - mean) ** 2)) / (len(batches) - 1)
    out["sgd_noise_snr_db"] = snr_db(float(mean @ mean), spread)
  return out


def propose_end_to_end(e2e: dict, flops_by_site: dict[str, float], target_db: float) -> list[str]:
  """Sites to run in e2e["recipe"] so that the whole-model gradient keeps >= target_db, most FLOPs
  first per unit of noise. Noise from different sites is close to independent, so noise powers add:
  predicted SNR = -10 log10(sum_s 10^(-snr_s / 10)). Check the result with end_to_end(sets=...)."""
  noise = {s: 10.0 ** (-r["grad_snr_db"] / 10.0) for s, r in e2e["sites"].items()}
  order = sorted(noise, key=lambda s: flops_by_site.get(s, 0.0) / max(noise[s], 1e-30), reverse=True)
  chosen, total, budget = [], 0.0, 10.0 ** (-target_db / 10.0)
  for site in order:
    if total + noise[site] <= budget:
      chosen.append(site)
      total += noise[site]
  return chosen


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


def table(rows: list[dict], chosen: dict[str, str] | None = None, e2e: dict | None = None) -> str:
  """The probe's console table: worst-of-three SNR per recipe, with y/dx/dw for MXFP8, and the
  whole-model gradient SNR with only that site in FP8 (`e2e`, from end_to_end)."""
  recipes = [r for r in rows[0]["snr_db"] if r != "bf16"] if rows else []
  head = f"{'site':<28} {'M':>6} {'K':>5} {'N':>5} | {'bf16/f32':>8} " + " ".join(f"{r:>11}" for r in recipes)
  head += "  mxfp8 y/dx/dw" + (f" {'e2e':>6}" if e2e else "") + ("   proposed" if chosen else "")
  lines = [head, "-" * len(head)]
  for row in rows:
    s = row["snr_db"]
    worst = lambda r: min(s[r].values())
    line = (f"{row['site']:<28} {row['rows']:>6} {row['k']:>5} {row['n']:>5} | {worst('bf16'):>8.1f} "
            + " ".join(f"{worst(r):>11.1f}" for r in recipes))
    if "mxfp8" in s:
      line += "  " + "/".join(f"{s['mxfp8'][q]:.1f}" for q in QUANTITIES)
    if e2e:
      line += f" {e2e['sites'].get(row['site'], {}).get('grad_snr_db', float('nan')):>6.1f}"
    if chosen:
      line += f"   {chosen[row['site']]}"
    lines.append(line)
  return "\n".join(lines)

"""Per-layer precision policy: layer-name patterns -> FP8 recipe, resolved for each layer as it is built.

Every Dense layer of the model is a *site*, named by its path in the module tree ("layers.0.hstu.uvqk",
"heads.trunk", "feature_proj.user_segment"). A Dense calls `resolve(site, K, N, PrecisionConfig)` when it
is built and keeps the recipe (gem_jax/precision/fp8.py) or None (plain matmul in the compute dtype), so
changing the policy never touches model code: the config names a policy and optional rules.

  PrecisionConfig(policy="fp8", rules=("layers.1.*=bf16",), min_dim=64, impl="auto")

Resolution per site, first match wins:
  1. `rules`: "pattern=recipe" (fnmatch patterns on the site name; recipe a fp8.RECIPES name, or
     "none" for the compute dtype). Applied as written.
  2. the named policy's own rules. For "fp8" a site whose recipe is an FP8 one but whose K or N is
     below `min_dim` stays bf16: small GEMMs gain nothing from FP8 and are the most sensitive.
  3. the policy's default.

Named policies:
  "none"  every site in the compute dtype (the behaviour without a policy).
  "bf16"  every site bf16 x bf16 -> float32.
  "fp8"   the default FP8 policy: MXFP8 (round-up scales) for the large dense matmuls (HSTU projections, Wukong MLPs, the
          shared tower layer of the heads), bf16 for the rest (embedding and summary projections,
          the feature-axis maps of Wukong). Embeddings, norms, attention, FM interactions and the
          per-domain logit towers are not sites: they keep the compute dtype (float32 norms/losses).
  <recipe> every site in that recipe, e.g. "mxfp8" (all-MXFP8) or "rowwise".

A probe (gem_jax/precision/probe.py) intercepts sites through `intercept`, which is a no-op unless a
probe context is active.
"""

from __future__ import annotations

import dataclasses
import fnmatch

from gem_jax import runtime
from gem_jax.precision import fp8

# MXFP8 with round-up scales: on the small config's sites the probe measured ~1.5 dB more SNR than
# floor scales at every site (floor saturates block maxima in (448, 512) to 448, gradients included),
# and all-MXFP8 training from the same seed ended closer to bf16 (experiments/fp8_parity.py).
_FP8_DEFAULT_RULES = (
    ("*hstu.uvqk", "mxfp8_rceil"),
    ("*hstu.out", "mxfp8_rceil"),
    ("*wukong.fm_mlp_in", "mxfp8_rceil"),
    ("*wukong.fm_mlp_out", "mxfp8_rceil"),
    ("heads.trunk", "mxfp8_rceil"),
)
POLICIES = {
    "none": ((), None),
    "bf16": ((), "bf16"),
    "fp8": (_FP8_DEFAULT_RULES, "bf16"),
    **{name: ((), name) for name in fp8.RECIPES},
}


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
  policy: str = "none"
  rules: tuple[str, ...] = ()    # "pattern=recipe", checked before the policy's own rules
  min_dim: int = 64              # "fp8" policy: FP8 only where K and N are both >= min_dim
  impl: str = "auto"             # fp8.IMPLS

  def __post_init__(self):
    if self.policy not in POLICIES:
      raise ValueError(f"precision.policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
    if self.impl not in fp8.IMPLS:
      raise ValueError(f"precision.impl must be one of {fp8.IMPLS}, got {self.impl!r}")
    if self.min_dim < 1:
      raise ValueError(f"precision.min_dim must be >= 1, got {self.min_dim}")
    self.parsed_rules()  # validates

  def parsed_rules(self) -> tuple[tuple[str, str | None], ...]:
    out = []
    for rule in self.rules:
      pattern, sep, recipe = rule.partition("=")
      if not sep or not pattern.strip():
        raise ValueError(f"precision.rules entries must read 'pattern=recipe', got {rule!r}")
      recipe = recipe.strip()
      if recipe != "none" and recipe not in fp8.RECIPES:
        raise ValueError(f"precision.rules {rule!r}: unknown recipe {recipe!r}; known: none, "
                         f"{', '.join(sorted(fp8.RECIPES))}")
      out.append((pattern.strip(), None if recipe == "none" else recipe))
    return tuple(out)


def resolve(site: str, in_features: int, out_features: int, cfg: PrecisionConfig) -> str | None:
  """The recipe of one site (None: compute dtype)."""
  for pattern, recipe in cfg.parsed_rules():
    if fnmatch.fnmatchcase(site, pattern):
      return recipe
  rules, default = POLICIES[cfg.policy]
  for pattern, recipe in rules:
    if fnmatch.fnmatchcase(site, pattern):
      if recipe != "bf16" and min(in_features, out_features) < cfg.min_dim:
        return "bf16"
      return recipe
  return default


def flop_share(sites, rows_by_site: dict[str, int] | None = None) -> dict[str, float]:
  """Share of the Dense sites' matmul FLOPs under each recipe ("none": compute dtype). `sites`: the
  model's (site, Dense) pairs (gem_jax/model/layers.py dense_sites). A site costs rows x K x N;
  `rows_by_site` (e.g. from a probe capture: tokens for sequence sites, examples for the rest) defaults
  to 1 row per site."""
  total, by = 0, {}
  for site, dense in sites:
    f = (rows_by_site or {}).get(site, 1) * dense.in_features * dense.out_features
    total += f
    key = dense.recipe or "none"
    by[key] = by.get(key, 0) + f
  return {k: v / total for k, v in sorted(by.items())}


# --- probe interception (gem_jax/runtime.py holds the probe while a probe traces) --------------------------

def probing(inputs: dict, taps: dict | None = None, swap: tuple | None = None, recipes: dict | None = None):
  """While active, every Dense site stores its input in `inputs[site]` and adds `taps[site]` (when given)
  to its output, so the gradient w.r.t. a zero tap is dL/d(site output). `swap = (recipe, select)` with
  select {site: bool scalar, possibly traced} replaces a site's output by its output under `recipe`
  where select is true: one compiled program can then switch sites between recipes at run time.
  `recipes` {site: recipe or None} overrides the recipe the layer was built with (None: compute dtype)."""
  return runtime.using(probe=runtime.Probe(inputs, taps or {}, swap, recipes))


def recipe_at_call(site: str, built: str | None) -> str | None:
  """The recipe a Dense site runs now: the one it was built with unless a probe overrides it."""
  probe = runtime.current().probe
  if probe is not None and probe.recipes is not None and site in probe.recipes:
    return probe.recipes[site]
  return built


def intercept(site: str, x, y, alternative=None):
  """Called by every Dense site with its input and output (and `alternative(recipe)`, its output under
  another recipe); returns the output to use. A no-op outside `probing`."""
  probe = runtime.current().probe
  if probe is None:
    return y
  probe.inputs[site] = x
  if probe.swap is not None and alternative is not None and site in probe.swap[1]:
    import jax.numpy as jnp
    y = jnp.where(probe.swap[1][site], alternative(probe.swap[0]).astype(y.dtype), y)
  return y + probe.taps[site] if site in probe.taps else y

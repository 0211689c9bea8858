"""The per-layer precision policy (site names, rule resolution, config plumbing) and the FP8 probe.

Compiling a tiny GEM's forward + backward takes ~10-30 s on CPU, so the expensive programs are shared:
one model (shared_model), one float32 value-and-gradient at init (reference), one probe capture
(captured), and the session's persistent compilation cache (tests/conftest.py), from which the second probe.end_to_end
call of a test loads the program the first call compiled instead of compiling it again.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gem_jax import configs
from gem_jax.config import apply_overrides
from gem_jax.data import pipeline
from gem_jax.data.synthetic import SyntheticAdsStream
from gem_jax.model.gem import GEM
from gem_jax.model.heads import multitask_loss
from gem_jax.model.layers import dense_sites
from gem_jax.precision import fp8, policy, probe
from gem_jax.precision.policy import PrecisionConfig


@pytest.fixture(scope="module")
def tiny():
  cfg = configs.get("tiny")
  spec = cfg.data.spec
  batch = pipeline.eval_batches(SyntheticAdsStream(spec, cfg.data.synthetic), spec, cfg.data.pipeline,
                                num_examples=cfg.data.pipeline.batch_size, start_index=0)[0]
  return cfg, batch


def with_precision(cfg, **kw):
  return dataclasses.replace(cfg.model, precision=PrecisionConfig(**kw))


@pytest.fixture(scope="module")
def shared_model(tiny):
  """One tiny GEM in float32 (policy "none") for the tests below; building one takes seconds. A test that
  needs another policy's recipes sets them at call time (policy.probing's `recipes`, `recipes_of`), the
  same override the probe uses; the recipes a config gives at build are checked on abstract models."""
  cfg, _ = tiny
  return GEM(cfg.data.spec, cfg.model, rngs=nnx.Rngs(0))


def recipes_of(model, **kw) -> dict:
  """{site: recipe} that PrecisionConfig(**kw) resolves for each Dense site of `model`."""
  pc = PrecisionConfig(**kw)
  return {site: policy.resolve(site, d.in_features, d.out_features, pc) for site, d in dense_sites(model)}


def built_recipes(cfg, **kw) -> dict:
  """{site: recipe} of a GEM built (abstractly: nothing allocated) under PrecisionConfig(**kw)."""
  model = nnx.eval_shape(lambda: GEM(cfg.data.spec, with_precision(cfg, **kw), rngs=nnx.Rngs(0)))
  return {site: d.recipe for site, d in dense_sites(model)}


def loss_fn(spec):
  return lambda model, batch: multitask_loss(model(batch), batch, spec)[0]



def value_and_grad_fn(model, spec, recipes=None):
  """(jitted (params, batch) -> (loss, grads), graphdef, params, rest) of the model with its sites under
  `recipes` (None: the recipes it was built with)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def f(p, b):
    with policy.probing({}, recipes=recipes):
      return loss_fn(spec)(nnx.merge(graphdef, p, rest), b)
  return jax.jit(jax.value_and_grad(f)), graphdef, params, rest


@pytest.fixture(scope="module")
def reference(tiny, shared_model):
  """The float32 (policy "none") loss and parameter gradients at init, and the graphdef / rest to merge
  the gradients into a model: one compile for the two tests that compare against it."""
  cfg, batch = tiny
  grad_fn, graphdef, params, rest = value_and_grad_fn(shared_model, cfg.data.spec)
  loss, grads = grad_fn(params, batch)
  return loss, grads, graphdef, rest


@pytest.fixture(scope="module")
def captured(tiny):
  """probe.capture on the tiny batch of a model built all-MXFP8 (the same parameters as shared_model: same
  seed): the capture must run every site in high precision whatever the model was built with."""
  cfg, batch = tiny
  model = GEM(cfg.data.spec, with_precision(cfg, policy="mxfp8"), rngs=nnx.Rngs(0))
  assert {d.recipe for _, d in dense_sites(model)} == {"mxfp8"}
  return probe.capture(model, dense_sites(model), [batch], loss_fn(cfg.data.spec))


def test_resolution_order_and_size_threshold():
  cfg = PrecisionConfig(policy="fp8", rules=("layers.1.hstu.*=rowwise", "heads.*=none"), min_dim=64)
  assert policy.resolve("layers.1.hstu.uvqk", 64, 256, cfg) == "rowwise"      # user rule first
  assert policy.resolve("heads.trunk", 512, 128, cfg) is None                  # "none": compute dtype
  assert policy.resolve("layers.0.hstu.uvqk", 64, 256, cfg) == "mxfp8_rceil"   # policy rule
  assert policy.resolve("layers.0.hstu.uvqk", 32, 256, cfg) == "bf16"          # below min_dim
  assert policy.resolve("layers.0.wukong.fm_mlp_out", 256, 256, cfg) == "mxfp8_rceil"
  assert policy.resolve("token_proj", 512, 512, cfg) == "bf16"                 # policy default
  assert policy.resolve("token_proj", 8, 8, PrecisionConfig(policy="mxfp8")) == "mxfp8"  # no threshold
  assert policy.resolve("token_proj", 8, 8, PrecisionConfig()) is None


def test_config_errors_name_the_problem():
  with pytest.raises(ValueError, match="precision.policy must be one of"):
    PrecisionConfig(policy="fp4")
  with pytest.raises(ValueError, match="'pattern=recipe'"):
    PrecisionConfig(rules=("layers.*",))
  with pytest.raises(ValueError, match="unknown recipe 'e4m3'"):
    PrecisionConfig(rules=("layers.*=e4m3",))
  with pytest.raises(ValueError, match="precision.impl"):
    PrecisionConfig(impl="cuda")


def test_command_line_overrides_reach_the_policy():
  cfg = apply_overrides(configs.get("tiny"), ["model.precision.policy=fp8",
                                              'model.precision.rules=["heads.trunk=rowwise"]',
                                              "model.precision.min_dim=16"])
  assert cfg.model.precision == PrecisionConfig(policy="fp8", rules=("heads.trunk=rowwise",), min_dim=16)
  with pytest.raises(ValueError, match="unknown recipe"):
    apply_overrides(configs.get("tiny"), ['model.precision.rules=["heads.trunk=int8"]'])


def test_a_rule_that_matches_no_site_is_refused_when_the_run_is_built():
  from gem_jax.run.build import build
  typo = apply_overrides(configs.get("tiny"), ["model.precision.policy=fp8",
                                               'model.precision.rules=["layer.*.hstu.out=bf16"]'])
  with pytest.raises(ValueError, match=r"'layer\.\*\.hstu\.out' matches no Dense site of the model; its sites "
                                       r"are \['"):
    build(typo, abstract=True)
  build(apply_overrides(configs.get("tiny"), ['model.precision.rules=["layers.*.hstu.out=bf16"]']), abstract=True)


def test_policy_changes_sites_without_model_code_changes(tiny, shared_model):
  cfg, _ = tiny
  by_policy = {name: built_recipes(cfg, policy=name, min_dim=32) for name in ("none", "bf16", "fp8", "mxfp8")}
  # The call-time override resolves the same recipes as a build does.
  assert recipes_of(shared_model, policy="fp8", min_dim=32) == by_policy["fp8"]
  sites = set(by_policy["none"])
  assert {"token_proj", "heads.trunk", "layers.0.hstu.uvqk", "layers.1.wukong.fm_mlp_in"} <= sites
  assert set(by_policy["none"].values()) == {None}
  assert set(by_policy["bf16"].values()) == {"bf16"} and set(by_policy["mxfp8"].values()) == {"mxfp8"}
  fp8_sites = {s for s, r in by_policy["fp8"].items() if r == "mxfp8_rceil"}
  assert fp8_sites == {"heads.trunk", "layers.0.hstu.uvqk", "layers.0.hstu.out", "layers.1.hstu.uvqk",
                       "layers.1.hstu.out", "layers.0.wukong.fm_mlp_in", "layers.0.wukong.fm_mlp_out",
                       "layers.1.wukong.fm_mlp_in", "layers.1.wukong.fm_mlp_out"}


def test_dense_under_a_recipe_is_the_fp8_dot_plus_bias(shared_model):
  dense = shared_model.heads.trunk
  x = jax.random.normal(jax.random.key(0), (5, dense.in_features))
  want = fp8.matmul(x, dense.kernel[...], "mxfp8", "emulate") + dense.bias[...][None]
  with policy.probing({}, recipes={"heads.trunk": "mxfp8"}):
    np.testing.assert_array_equal(np.asarray(dense(x)), np.asarray(want))
  np.testing.assert_allclose(np.asarray(dense(x)), np.asarray(x @ dense.kernel[...] + dense.bias[...][None]),
                             rtol=1e-5, atol=1e-5)


def test_fp8_model_forward_and_gradients_track_float32(tiny, shared_model, reference):
  """The whole model under bf16 and all-MXFP8 at init: loss close to float32, gradients finite, and the
  whole-model gradient SNR ordered by precision. Per GEMM MXFP8 keeps ~27 dB (test_probe_snr_and_proposal);
  through the backward chain the errors compound to ~13 dB on the tiny model (bf16: ~37 dB)."""
  cfg, batch = tiny
  spec = cfg.data.spec

  def loss_and_grad(name):
    grad_fn, _, params, _ = value_and_grad_fn(shared_model, spec, recipes_of(shared_model, policy=name))
    return grad_fn(params, batch)

  def snr(grads, ref):
    num = sum(float(jnp.sum(jnp.square(a - b))) for a, b in zip(jax.tree_util.tree_leaves(grads),
                                                                  jax.tree_util.tree_leaves(ref)))
    return 10 * np.log10(sum(float(jnp.sum(jnp.square(b))) for b in jax.tree_util.tree_leaves(ref)) / num)

  loss32, g32 = reference[:2]  # policy "none"
  loss16, g16 = loss_and_grad("bf16")
  loss8, g8 = loss_and_grad("mxfp8")
  assert abs(float(loss8) - float(loss32)) < 0.02 * abs(float(loss32))
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(g8))
  assert snr(g16, g32) > 30.0 and 8.0 < snr(g8, g32) < snr(g16, g32) - 10.0


def test_probe_capture_gives_each_sites_input_and_output_gradient(captured, reference):
  """x^T g of a captured site is the loss gradient of that site's kernel (chain rule)."""
  caps = captured
  _, grads, graphdef, rest = reference  # float32: what the capture runs in, whatever the model's policy
  grad_model = nnx.merge(graphdef, grads, rest)
  for site, module in (("heads.trunk", grad_model.heads.trunk), ("layers.0.hstu.uvqk", grad_model.layers[0].hstu.uvqk),
                       ("token_proj", grad_model.token_proj)):
    cap = caps[site]
    x, g = cap.xs_MxK[0], cap.gs_MxN[0]
    assert x.shape[1] == module.in_features and g.shape == (x.shape[0], module.out_features)
    np.testing.assert_allclose(x.T @ g, np.asarray(module.kernel[...]), rtol=2e-4,
                               atol=2e-6 * np.abs(x.T @ g).max())


def test_probe_snr_and_proposal(tiny, captured):
  caps = {s: captured[s] for s in ("layers.0.hstu.uvqk", "heads.trunk")}
  rows = probe.measure(caps, recipes=("mxfp8", "tensorwise"))
  for row in rows:
    snr = row["snr_db"]
    assert min(snr["bf16"].values()) > 40            # bf16 vs float32: 8 significand bits
    assert 20 < min(snr["mxfp8"].values()) < 35      # E4M3: 4 significand bits
    assert max(snr["mxfp8"].values()) < min(snr["bf16"].values())
  assert set(probe.propose(rows, threshold_db=60).values()) == {"bf16"}
  chosen = probe.propose(rows, threshold_db=10, preference=("tensorwise", "mxfp8"))
  assert set(chosen.values()) == {"tensorwise"}
  # The proposal is a config: a model built with it has exactly those recipes.
  built = built_recipes(tiny[0], policy="bf16", rules=probe.as_rules(chosen))
  assert {s: r for s, r in built.items() if s in chosen} == chosen
  assert "heads.trunk" in probe.table(rows, chosen)


def test_snr_db_edge_cases():
  assert probe.snr_db(1.0, 0.0) == float("inf")
  assert probe.snr_db(0.0, 1.0) == float("-inf")
  assert probe.snr_db(100.0, 1.0) == pytest.approx(20.0)
  assert json.dumps(probe.snr_db(1.0, 0.0)) == "Infinity"


def test_end_to_end_probe_switches_sites_at_run_time(tiny, shared_model):
  cfg, batch = tiny
  spec = cfg.data.spec
  model, sites = shared_model, dense_sites(shared_model)
  e2e = probe.end_to_end(model, sites, [batch], loss_fn(spec), "mxfp8_rceil",
                         sets={"nothing": [], "uvqk": ["layers.0.hstu.uvqk"]})
  singles = {s: r["grad_snr_db"] for s, r in e2e["sites"].items()}
  assert set(singles) == {s for s, _ in sites}
  assert e2e["sets"]["nothing"]["grad_snr_db"] == float("inf")       # nothing swapped: identical grads
  assert e2e["sets"]["uvqk"]["grad_snr_db"] == singles["layers.0.hstu.uvqk"]
  assert all(5.0 < v < 60.0 for v in singles.values())
  assert e2e["all"]["grad_snr_db"] < min(singles.values())           # noise adds up
  # The greedy proposal's prediction (noise powers add) holds when measured.
  flops = {s: 1.0 for s in singles}
  target = sorted(singles.values())[len(singles) // 2] - 3.0
  chosen = probe.propose_end_to_end(e2e, flops, target)
  predicted = -10 * np.log10(sum(10 ** (-singles[s] / 10) for s in chosen))
  assert chosen and predicted >= target
  measured = probe.end_to_end(model, sites, [batch], loss_fn(spec), "mxfp8_rceil", sets={"p": chosen},
                              singles=False)
  assert abs(measured["sets"]["p"]["grad_snr_db"] - predicted) < 2.0

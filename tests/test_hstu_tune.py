"""The tiled HSTU loop's autotuner (pallas_kernels/hstu_attention/tune.py): it times each candidate once per shape
bucket, keeps the fastest in memory and in its file, reads the file instead of timing again, runs inside a step's
trace, and a run with model.hstu.attn_tiles=auto reports its picks in report.json."""

import json

import jax
import jax.numpy as jnp
import pytest

from gem_jax import ops
from gem_jax.check import ConfigError
from pallas_kernels.hstu_attention import reference, tiled, tune
from tests import run_helpers
from tests.kernel_helpers import hstu_inputs, max_rel_err

TWO = (tiled.TileConfig(8, 1), tiled.TileConfig(16, 4))


def _bucket(**over):
  b = {"platform": "cpu", "device_kind": "cpu", "jax": jax.__version__, "capacity": 64, "rows": 4, "heads": 2,
       "dh": 8, "dv": 8, "max_seq_len": 24, "causal": True, "has_targets": True, "max_attn_len": 0,
       "contextual_seq_len": 2, "num_buckets": 6, "dtype": "float32"}
  return {**b, **over}


def test_synthetic_rows_fit_the_bucket_and_are_fixed_by_the_seed():
  b = _bucket()
  q, _, v, _, offsets, targets, bias = tune.synthetic_rows(b, seed=3)
  lengths = jnp.diff(offsets)
  assert q.shape == (64, 2, 8) and v.shape == (64, 2, 8) and offsets.shape == (5,) and bias.shape == (2, 6)
  assert int(offsets[-1]) <= 64 and int(lengths.min()) >= 1 and int(lengths.max()) <= 24
  assert targets.shape == (4,) and bool(jnp.all(targets <= lengths))
  assert bool(jnp.all(tune.synthetic_rows(b, seed=3)[4] == offsets))


def test_the_fastest_candidate_is_picked_once_and_read_back_from_the_file(tmp_path, monkeypatch):
  calls = []
  fake = {TWO[0]: 0.002, TWO[1]: 0.001}

  def timed(b, candidates, *, reps, seed=0):
    calls.append(b["capacity"])
    return {tc: fake[tc] for tc in candidates}

  monkeypatch.setattr(tune, "time_configs", timed)
  path = tmp_path / "tiles.json"
  tuner = tune.Tuner(str(path), candidates=TWO)
  assert tuner.pick(_bucket()) == TWO[1]
  assert tuner.pick(_bucket()) == TWO[1] and calls == [64]           # timed once per bucket
  assert tuner.pick(_bucket(capacity=128)) == TWO[1] and calls == [64, 128]
  saved = json.loads(path.read_text())
  assert len(saved) == 2 and {e["timings_ms"]["8x1"] for e in saved.values()} == {2.0}
  [used] = [r for r in tuner.report() if r["bucket"]["capacity"] == 64]
  assert (used["block"], used["group"], used["source"]) == (16, 4, "timed")

  monkeypatch.setattr(tune, "time_configs", lambda *a, **k: pytest.fail("a pick on file was timed again"))
  again = tune.Tuner(str(path), candidates=TWO)
  assert again.pick(_bucket()) == TWO[1] and again.report()[0]["source"] == "file"


def test_a_bad_tile_file_is_named_and_a_multi_process_run_does_not_time(tmp_path, monkeypatch):
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  with pytest.raises(ValueError, match="bad.json: not a readable JSON file of HSTU tile picks"):
    tune.Tuner(str(bad))
  bad.write_text(json.dumps({"k": {"block": 0, "group": 4}}))
  with pytest.raises(ValueError, match=r"bad.json: the pick of bucket k needs integer 'block' and 'group' >= 1"):
    tune.Tuner(str(bad))
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(tune, "time_configs", lambda *a, **k: pytest.fail("a multi-process run timed a bucket"))
  with pytest.raises(RuntimeError, match="2-process run: bucket .* is not in"):
    tune.Tuner(None, candidates=TWO).pick(_bucket())


def test_auto_tiles_inside_a_trace_time_the_candidates_and_keep_the_values(monkeypatch):
  tuner = tune.Tuner(None, candidates=TWO, reps=1)
  monkeypatch.setattr(tune, "default", lambda: tuner)
  (q, k, v, bias), offsets_Bp1, _, kwargs = hstu_inputs("contextual_targets_bias", jnp.float32)
  got = jax.jit(lambda q, k, v: ops.hstu_attention(q, k, v, offsets_Bp1, rel_bias_HxR=bias, impl="xla",
                                                   tiles="auto", **kwargs))(q, k, v)
  want = reference.hstu_attention(q, k, v, offsets_Bp1, rel_bias_HxR=bias, **kwargs)
  assert max_rel_err(got, want) <= 1e-5
  [pick] = ops.hstu_tile_picks()
  assert pick["bucket"]["contextual_seq_len"] == 3 and pick["bucket"]["has_targets"]
  assert set(pick["timings_ms"]) == {"8x1", "16x4"} and all(t > 0 for t in pick["timings_ms"].values())
  # Impls without tiles ignore "auto" and refuse a TileConfig.
  ops.hstu_attention(q, k, v, offsets_Bp1, rel_bias_HxR=bias, impl="reference", tiles="auto", **kwargs)
  with pytest.raises(ValueError, match="setting of the 'xla' impl"):
    ops.hstu_attention(q, k, v, offsets_Bp1, impl="reference", tiles=TWO[0], **kwargs)


def test_attn_tiles_setting_is_checked_and_reaches_the_layer():
  with pytest.raises((ValueError, ConfigError), match="attn_tiles must be 'default', 'auto' or"):
    run_helpers.tiny("model.hstu.attn_tiles=32")
  assert run_helpers.tiny("model.hstu.attn_tiles=16x4").model.hstu.tiles() == (16, 4)
  assert run_helpers.tiny().model.hstu.tiles() is None


@pytest.mark.slow
def test_a_run_with_auto_tiles_reports_its_picks(tmp_path, monkeypatch):
  from gem_jax.train import jobs
  tuner = tune.Tuner(str(tmp_path / "tiles.json"), candidates=TWO, reps=1)
  monkeypatch.setattr(tune, "default", lambda: tuner)
  # One GEM layer: each of its attention shapes is a bucket the tuner times two candidates for.
  cfg = run_helpers.tiny("model.hstu.attn_tiles=auto", *run_helpers.ONE_LAYER,
                         **{"train.steps": 2, "train.warmup_steps": 1, "train.eval_every": 2,
                            "train.checkpoint_every": 2, "train.log_every": 1})
  jobs.train_config(cfg, str(tmp_path / "run"), progress=False)
  picks = json.loads((tmp_path / "run" / "report.json").read_text())["hstu_tiles"]
  assert picks and all((p["block"], p["group"]) in {(8, 1), (16, 4)} and p["source"] == "timed" for p in picks)
  assert {p["bucket"]["contextual_seq_len"] for p in picks} == {cfg.model.hstu.num_contextual}
  assert len(json.loads((tmp_path / "tiles.json").read_text())) == len(picks)

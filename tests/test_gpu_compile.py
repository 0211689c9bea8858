"""The tiny config compiled for GPUs this machine does not have (gem_jax/observe/gpu_compile.py): two hosts of
four H200s, through XLA:GPU's own compiler in the CUDA plugin (`pip install -e '.[aot]'`; the
README's test command installs it).

What only the GPU compiler can show, checked on every CI run: the HSTU kernels and the FP8 GEMMs compile
as Triton (forward and backward), the collectives of a two-host program land on the mesh axes the simulator
puts them on, with the bytes it predicts, and the embedding update's scatter-adds use native float atomics.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import jax
import pytest

import gem_jax
from gem_jax import configs, xla_env
from gem_jax.config import apply_overrides
from gem_jax.observe import gpu_compile
from tests.run_helpers import ONE_LAYER

PLUGIN = importlib.util.find_spec("jax_plugins") is not None and xla_env.cuda_plugin_installed()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not PLUGIN, reason="no CUDA plugin for jax: GPU programs cannot be compiled here (pip install -e '.[aot]')")]


def tiny_on(mesh: str, *sets: str):
  return apply_overrides(configs.get("tiny"), [f"mesh=meshes/{mesh}.yaml", *sets])


@pytest.fixture(scope="module")
def two_hosts():
  """One compile for every test here (a GPU compile of tiny costs about a minute on 2 cores): the train and
  eval steps on two hosts of four H200s (one GEM layer: a second is the same kernels at a shorter length), with
  FP8 on two sites and both Hopper paths: the HSTU projections
  in MXFP8 (the Pallas MX kernel) and the heads' trunk row-wise (XLA's own FP8 GEMM). Tiny's dims are under
  the fp8 policy's min_dim, which would leave every site in bf16; a few sites keep the compile short (each
  FP8 GEMM is a kernel of its own)."""
  return gpu_compile.compile_for(tiny_on("h200_2x4", *ONE_LAYER,
                                        'model.precision.rules=["*hstu.uvqk=mxfp8_rceil", "heads.trunk=rowwise"]'))


def test_report_schema(two_hosts):
  r = json.loads(json.dumps(two_hosts, default=str))
  assert (r["target"], r["topology"], r["devices"]) == ("h200", "1x2x4", 8)
  for name in ("train", "eval"):
    p = r["programs"][name]
    assert p["compiled"] and p["error"] is None and p["compile_s"] > 0
    assert set(p["memory"]) >= {"argument", "output", "temp", "peak"} and 0 < p["memory"]["peak"] < r["hbm_bytes"]
  assert {k["kind"] for k in r["kernels"]} <= {"triton", "mosaic_gpu", "interpreted", "xla"}
  assert set(r["fp8"]) >= {"gemms", "sites"} and set(r["simulator"]) >= {"peak_bytes", "collective_bytes_by_axis"}
  assert r["scatter_atomics"] in ("native", "cas", "none")


def test_hstu_kernels_compile_as_triton_forward_and_backward(two_hosts):
  kinds = {(k["program"], k["name"]): k["kind"] for k in two_hosts["kernels"]}
  for name in ("hstu_attention_fwd", "hstu_attention_dq", "hstu_attention_dkv"):
    assert kinds[("train", name)] == "triton"
  assert kinds[("eval", "hstu_attention_fwd")] == "triton"
  assert "interpreted" not in kinds.values()


def test_every_fp8_site_is_an_fp8_gemm_forward_and_backward(two_hosts):
  """Each site's forward GEMM in both programs and its weight gradient in the train step; the input
  gradient too unless nothing upstream needs it (XLA drops it: a site on the batch's dense features)."""
  fp8 = two_hosts["fp8"]
  assert fp8["sites"] == 2 and fp8["sites_with_fp8_forward"] == 2 and not fp8["sites_without"]
  for site in fp8["site_names"]:
    got = fp8["by_site"][site]
    assert got["train_forward"] == got["eval_forward"] == 1 and got["train_backward"] in (1, 2), (site, got)
  assert 2 * fp8["sites"] < fp8["gemms"] <= 3 * fp8["sites"]
  assert "" not in fp8["by_site"]  # every FP8 GEMM belongs to a site


def test_two_hosts_collectives_match_the_simulator(two_hosts):
  assert set(two_hosts["simulator"]) >= {"peak_bytes", "collective_bytes_by_axis"}
  by_axis = two_hosts["comparison"]["collectives_by_axis"]
  assert "replica,sparse" in by_axis and "sparse" in by_axis  # the tables' sync crosses hosts, lookups do not
  for axis, c in by_axis.items():
    assert c["ratio"] is not None and abs(c["ratio"] - 1) <= 0.10, (axis, c)
  assert any(c["async"] for c in two_hosts["collectives"])
  assert two_hosts["programs"]["train"]["compiled"]


@pytest.mark.skipif(not xla_env.affected(jax.lib.__version__), reason=f"jaxlib {jax.lib.__version__} emits native "
                    "float atomics for scatter-add without the workaround")
def test_scatter_atomics_native_with_the_guard_and_a_cas_loop_without(two_hosts, tmp_path):
  assert gem_jax.XLA_ENV in ("set", "present")
  assert two_hosts["scatter_atomics"] == "native"
  # Without the guard (a fresh process: the flag only counts before jax starts) the loop comes back.
  code = ("import jax, jax.numpy as jnp\n"
          "from gem_jax.parallel import mesh as mesh_lib, target\n"
          "from gem_jax.observe import compiled\n"
          "from jax.sharding import Mesh, NamedSharding, PartitionSpec as P\n"
          "import numpy as np\n"
          "mesh = Mesh(np.array(target.topology_devices(target.get('h200'), mesh_lib.ONE_DEVICE)), ('x',))\n"
          "s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P()))\n"
          "f = jax.jit(lambda t, i, u: t.at[i].add(u))\n"
          "c = f.lower(s((1000,), jnp.float32), s((64,), jnp.int32), s((64,), jnp.float32)).compile("
          f"compiler_options={{'xla_dump_to': {str(tmp_path)!r}}})\n"
          "print(compiled.scatter_atomics(c.as_text(), " + repr(str(tmp_path)) + ")['verdict'])\n")
  env = dict(os.environ, GEM_JAX_FTZ_ATOMICS="0", JAX_PLATFORMS="cpu",
             XLA_FLAGS=xla_env.without_ftz_atomics(os.environ.get("XLA_FLAGS", "")))
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip().splitlines()[-1] == "cas"


def test_a_next_item_config_compiles_for_a_gpu_with_the_chunked_loss_and_a_cpu_tile_setting(tmp_path):
  """The next-item task (SeqRecModelConfig, no precision policy) through compile_for: SASRec with a softmax
  block set for the CPU loop, which the GPU's Pallas kernel must drop, and the chunked full softmax. Its
  eval program reads validation batches (targets and an exclusion mask), not training ones."""
  from tests.data_helpers import toy_u_data
  cfg = apply_overrides(configs.seqrec("ml-100k", quick=True), [
      "mesh=meshes/h200_1.yaml", f"data.data_dir={toy_u_data(tmp_path)}", "data.batch_size=8",
      "data.token_multiple=64", "model.arch=sasrec", "model.attn_block=8", "task.loss=full_softmax",
      "model.num_layers=1"])
  report = gpu_compile.compile_for(cfg, programs=("train", "eval"), simulate=False)
  for program in ("train", "eval"):
    assert report["programs"][program]["compiled"], report["programs"][program]
    assert any(k["name"].startswith("jagged_softmax_attention") and k["program"] == program
               for k in report["kernels"]), (program, report["kernels"])
  assert report["precision_policy"] is None and report["attn_impl"] == "auto"

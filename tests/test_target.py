"""Compile targets: the shipped target files, mesh files naming one, and the rule that the platform a step is
built for, not the host's backend, picks kernels, interpret mode and the FP8 path (gem_jax/parallel/target.py).

The lowering tests export for CUDA from this CPU machine (jax.export, no plugin needed) with a target
installed in the runtime the way parallel/spmd.py installs it around a step, and read the Triton calls back.
"""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from gem_jax import ops, runtime
from gem_jax.parallel import mesh as mesh_lib
from gem_jax.parallel import target as target_lib
from gem_jax.parallel.mesh import MeshFileError
from gem_jax.precision import fp8

MESHES = pathlib.Path(__file__).resolve().parents[1] / "meshes"
_TRITON_CALL = "__gpu$xla.gpu.triton"


@pytest.mark.parametrize("name", ["h100", "h200", "b200"])
def test_shipped_targets_load_and_describe_the_gpu(name):
  t = target_lib.get(name)
  assert t.platform == "gpu" and t.compile_only and t.name == name
  proto = t.gpu_target_config()
  assert f"core_count: {t.sm_count}" in proto and f"major: {t.compute_capability[0]}" in proto
  assert f"device_memory_size: {t.device_memory_bytes}" in proto and t.device in proto
  assert t.has_fp8_tensor_cores and t.has_mx_tensor_cores == (t.compute_capability >= (10, 0))
  assert set(target_lib.names()) >= {"h100", "h200", "b200"}


def _write(tmp_path, data, name="t.yaml"):
  path = tmp_path / name
  path.write_text(yaml.safe_dump(data))
  return str(path)


@pytest.mark.parametrize("change, message", [
    ({"sm_count": None}, "missing keys \\['sm_count'\\]"),
    ({"compute_capability": "9.0"}, "compute_capability must read \\[major, minor\\]"),
    ({"shared_memory_per_block_optin": 0}, "shared_memory_per_block_optin must be a positive integer"),
    ({"clock_ghz": "fast"}, "clock_ghz must be a positive number"),
    ({"hbm": 1}, "unknown keys \\['hbm'\\]"),
])
def test_a_bad_target_file_names_the_file_and_field(tmp_path, change, message):
  data = yaml.safe_load((pathlib.Path(target_lib.__file__).parent / "targets" / "h200.yaml").read_text())
  for k, v in change.items():
    if v is None:
      del data[k]
    else:
      data[k] = v
  path = _write(tmp_path, data)
  with pytest.raises(target_lib.TargetError, match=re.escape(path) + ".*" + message):
    target_lib.get(path)
  with pytest.raises(target_lib.TargetError, match="unknown target 'h300'"):
    target_lib.get("h300")


def test_gpu_mesh_files_name_their_target_and_topology():
  gpu = {p.stem: mesh_lib.load(p) for p in MESHES.glob("h200_*.yaml")}
  assert gpu and all(spec.target == "h200" for spec in gpu.values())
  assert target_lib.topology(gpu["h200_1"]) == "1x1x1" and target_lib.topology(gpu["h200_2x4"]) == "1x2x4"
  assert target_lib.topology(gpu["h200_1024_5d"]) == "1x128x8"
  assert mesh_lib.load(MESHES / "cpu_8.yaml").target is None


def test_a_mesh_file_with_an_unknown_target_fails_naming_it(tmp_path):
  data = yaml.safe_load((MESHES / "h200_8.yaml").read_text())
  path = _write(tmp_path, {**data, "target": "a100"}, "h200_8.yaml")
  with pytest.raises(MeshFileError, match=re.escape(path) + ": target: unknown target 'a100'"):
    mesh_lib.load(path)
  # A target file next to the mesh file, by relative path.
  target_data = yaml.safe_load((pathlib.Path(target_lib.__file__).parent / "targets" / "h100.yaml").read_text())
  _write(tmp_path, {**target_data, "name": "mine"}, "mine.yaml")
  spec = mesh_lib.load(_write(tmp_path, {**data, "target": "mine.yaml"}, "h200_8.yaml"))
  assert target_lib.get(spec.target).name == "mine"


def test_the_target_of_a_mesh():
  cpu = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape((1,) * 5), mesh_lib.MESH_AXES)
  assert target_lib.of(cpu, mesh_lib.ONE_DEVICE) is target_lib.CPU
  assert target_lib.of(mesh_lib.build_abstract_mesh(mesh_lib.ONE_DEVICE)) is None


# ------------------------------------------------------------------------------- the target decides

def _h200_abstract_mesh():
  """jax >= 0.11 lowers Pallas-Triton for the GPU of the context mesh's abstract device (0.10 does not ask)."""
  h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
  return jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=h200)


def _exported(fn, *args, calls=(_TRITON_CALL,)) -> str:
  """fn exported for CUDA, as StableHLO text (`calls`: the custom call targets let through)."""
  with jax.sharding.use_abstract_mesh(_h200_abstract_mesh()):
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"],
                                 disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(c) for c in calls])(*args)
  return exported.mlir_module()


def _triton_calls(fn, *args) -> list[str]:
  """Names of the Triton calls of fn exported for CUDA (one per distinct call: a jitted kernel wrapper
  called twice with the same shapes is one function of the module)."""
  return sorted(re.findall(r'custom_call @__gpu\$xla\.gpu\.triton.*?name = "([^"]+)"', _exported(fn, *args)))


def _in_step(target, fn):
  """fn traced with `target` installed, as parallel/spmd.py installs it inside the step's body: the
  gradient is taken outside, so its backward is traced after the target is uninstalled."""
  def traced(*args):
    with runtime.using(target=target):
      return fn(*args)
  return traced


def _attention_loss(q_TxHxD, offsets_Bp1):
  out = ops.hstu_attention(q_TxHxD, q_TxHxD, q_TxHxD, offsets_Bp1, max_seq_len=16, alpha=0.5, impl="auto")
  return out.astype(jnp.float32).sum()


def test_attention_auto_follows_the_target_not_the_host():
  args = (jax.ShapeDtypeStruct((32, 2, 16), jnp.float32), jax.ShapeDtypeStruct((3,), jnp.int32))
  h200 = jax.value_and_grad(_in_step(target_lib.get("h200"), _attention_loss))
  assert _triton_calls(h200, *args) == ["hstu_attention_dkv", "hstu_attention_dq", "hstu_attention_fwd"]
  # The same code built for the CPU: the C++ kernel's CPU custom calls (pallas_kernels/hstu_attention/cpu.py), and
  # no Triton kernel.
  cpu_kernel = ("gem_hstu_cpu_forward", "gem_hstu_cpu_backward")
  text = _exported(jax.value_and_grad(_in_step(target_lib.CPU, _attention_loss)), *args,
                   calls=(_TRITON_CALL, *cpu_kernel))
  assert sorted(set(re.findall(r"custom_call @(\w+)", text))) == sorted(cpu_kernel)


@pytest.mark.parametrize("target, recipe, impl", [
    ("cpu", "mxfp8_rceil", "emulate"), ("h200", "mxfp8_rceil", "pallas"), ("b200", "mxfp8_rceil", "xla"),
    ("h200", "rowwise", "xla"), ("h100", "tensorwise", "xla")])
def test_fp8_auto_follows_the_target(target, recipe, impl):
  t = target_lib.CPU if target == "cpu" else target_lib.get(target)
  with runtime.using(target=t):
    assert fp8.resolve_impl("auto", fp8.get_recipe(recipe)) == impl


def test_fp8_backward_gemms_keep_the_forward_s_target():
  """All three GEMMs of an MX site on Hopper are FP8 Triton kernels, the two backward ones included."""
  def loss(x_MxK, w_KxN):
    return fp8.matmul(x_MxK, w_KxN, "mxfp8_rceil").sum()
  args = (jax.ShapeDtypeStruct((64, 64), jnp.float32), jax.ShapeDtypeStruct((64, 32), jnp.float32))
  grad = jax.value_and_grad(_in_step(target_lib.get("h200"), loss), argnums=(0, 1))
  text = _exported(grad, *args)
  # The kernel, and no dot of XLA's own: an emulated (or forgotten) GEMM would be a dot_general.
  assert set(re.findall(r'name = "([^"]+)"', text)) == {"fp8_mx_gemm"}
  assert "stablehlo.dot_general" not in text and "stablehlo.dot " not in text


def test_compiling_for_a_mesh_file_without_a_target_says_what_to_add():
  from gem_jax import configs
  from gem_jax.config import apply_overrides
  from gem_jax.observe import gpu_compile
  cfg = apply_overrides(configs.get("tiny"), [f"mesh={MESHES / 'cpu_8.yaml'}"])
  with pytest.raises(ValueError, match="names no target; add `target: h200`"):
    gpu_compile.compile_for(cfg)
  with pytest.raises(ValueError, match="names no mesh file"):
    gpu_compile.compile_for(configs.get("tiny"))

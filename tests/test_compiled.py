"""What the compiler made of a program, read from text (gem_jax/observe/compiled.py): kernels, FP8 GEMMs and
scatter atomics on hand-written HLO and PTX in the forms XLA:GPU prints; the async overlap of collectives
(gem_jax/observe/hlo.py); the scatter-add workaround's flag handling (gem_jax/xla_env.py); compile_for's
default folder."""

from __future__ import annotations

import os

import jax
import pytest

from gem_jax import xla_env
from gem_jax.observe import compiled, hlo

HLO = """\
HloModule jit_train_step, is_scheduled=true, num_partitions=1

%gemm_f8 (p0: f8e4m3fn[64,32], p1: f8e4m3fn[32,16]) -> f32[64,16] {
  %p0 = f8e4m3fn[64,32]{1,0} parameter(0)
  %p1 = f8e4m3fn[32,16]{1,0} parameter(1)
  ROOT %dot.1 = f32[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%gemm_bf16 (q0: bf16[64,32], q1: bf16[32,16]) -> f32[64,16] {
  %q0 = bf16[64,32]{1,0} parameter(0)
  %q1 = bf16[32,16]{1,0} parameter(1)
  ROOT %dot.2 = f32[64,16]{1,0} dot(%q0, %q1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%fused_scatter (t: f32[100], i: s32[8,1], u: f32[8]) -> f32[100] {
  %t = f32[100]{0} parameter(0)
  %i = s32[8,1]{1,0} parameter(1)
  %u = f32[8]{0} parameter(2)
  ROOT %sc = f32[100]{0} scatter(%t, %i, %u), update_window_dims={}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
}

ENTRY %main (a: f8e4m3fn[64,32], b: f8e4m3fn[32,16], c: bf16[64,32], d: bf16[32,16], t: f32[100], i: s32[8,1], u: f32[8]) -> f32[100] {
  %a = f8e4m3fn[64,32]{1,0} parameter(0)
  %b = f8e4m3fn[32,16]{1,0} parameter(1)
  %c = bf16[64,32]{1,0} parameter(2)
  %d = bf16[32,16]{1,0} parameter(3)
  %t = f32[100]{0} parameter(4)
  %i = s32[8,1]{1,0} parameter(5)
  %u = f32[8]{0} parameter(6)
  %g1 = f32[64,16]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_f8, metadata={op_name="jit(train_step)/transpose(jvp(fp8_site=heads.trunk))/dot_general"}, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %g2 = f32[64,16]{1,0} fusion(%c, %d), kind=kCustom, calls=%gemm_bf16, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %g3 = (f32[64,16]{1,0}, s8[1024]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul$f8", metadata={op_name="jit(train_step)/jvp(fp8_site=heads.trunk)/dot_general"}
  %k1 = f32[64,16]{1,0} custom-call(%a, %b), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(train_step)/jvp(fp8_site=layers.0.hstu.uvqk)/jit(mx_gemm)/fp8_mx_gemm/pallas_call"}, backend_config={grid_x = 1 : i32, name = "fp8_mx_gemm", num_warps = 4 : i32}
  %k2 = f32[64,16]{1,0} custom-call(%c, %d), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(train_step)/jvp()/hstu_attention_fwd/pallas_call"}, backend_config={grid_x = 1 : i32, name = "hstu_attention_fwd", num_warps = 4 : i32}
  %w = f32[64,16]{1,0} add(%g1, %g2), metadata={op_name="jit(train_step)/transpose(jvp())/hstu_attention_dq/while/body/add"}
  %input_scatter_fusion.1 = f32[100]{0} fusion(%t, %i, %u), kind=kInput, calls=%fused_scatter, metadata={op_name="jit(train_step)/embedding_update/table=user_id/scatter-add"}
  %input_scatter_fusion.2 = f32[100]{0} fusion(%input_scatter_fusion.1, %i, %u), kind=kInput, calls=%fused_scatter, metadata={op_name="jit(train_step)/embedding_update/table=ad_id/scatter-add" deduplicated_name="input_scatter_fusion.1"}
  ROOT %out = f32[100]{0} fusion(%input_scatter_fusion.2, %i, %u), kind=kInput, calls=%fused_scatter, metadata={op_name="jit(train_step)/embedding_update/table=hour/scatter-add"}
}
"""


def test_kernels_by_kind():
  got = {(k["name"], k["kind"]): k["count"] for k in compiled.kernels(HLO)}
  assert got == {("fp8_mx_gemm", "triton"): 1, ("hstu_attention_fwd", "triton"): 1,
                 ("hstu_attention_dq", "interpreted"): 1, ("__triton_nested_gemm_fusion", "xla"): 2,
                 ("__cublas$lt$matmul$f8", "xla"): 1}


def test_fp8_gemms_count_float8_operands_only():
  gemms = compiled.fp8_gemms(HLO)
  got = {(g["name"], g["kind"], g["site"], g["pass"]): g["count"] for g in gemms}
  # The bf16 Triton GEMM is not one; the f8 fusion, cuBLASLt's FP8 matmul and the Pallas MX kernel are,
  # each attributed to the site its op_name names, the transposed one as a backward GEMM.
  assert got == {("__triton_nested_gemm_fusion", "xla", "heads.trunk", "backward"): 1,
                 ("__cublas$lt$matmul$f8", "xla", "heads.trunk", "forward"): 1,
                 ("fp8_mx_gemm", "triton", "layers.0.hstu.uvqk", "forward"): 1}
  assert compiled.count(gemms) == 3
  assert compiled.fp8_by_site(gemms) == {"heads.trunk": {"forward": 1, "backward": 1},
                                         "layers.0.hstu.uvqk": {"forward": 1, "backward": 0}}


PTX_CAS = """.visible .entry input_scatter_fusion_1(
  .param .u64 p0) {
$L__BB0_2:
  atom.relaxed.sys.global.cas.b32   %r2, [%rd1], %r8, %r7;
  @%p1 bra $L__BB0_2;
}
"""
PTX_NATIVE = """.visible .entry input_scatter_fusion_1(
  .param .u64 p0) {
  atom.relaxed.sys.global.add.f32   %r6, [%rd1], %r5;
}
.visible .entry out(
  .param .u64 p0) {
  red.global.add.v4.f32 [%rd2], {%f1, %f2, %f3, %f4};
}
"""
PTX_INTS = """.visible .entry input_scatter_fusion_1(
  .param .u64 p0) {
  atom.relaxed.sys.global.max.s32   %r6, [%rd1], %r5;
}
"""


@pytest.mark.parametrize("ptx, verdict", [(PTX_CAS, "cas"), (PTX_NATIVE, "native"), (PTX_INTS, "none")])
def test_scatter_atomics_from_the_ptx(tmp_path, ptx, verdict):
  (tmp_path / "module_0001.jit_train_step.3.ptx").write_text(ptx)
  got = compiled.scatter_atomics(HLO, str(tmp_path))
  assert got["verdict"] == verdict
  # input_scatter_fusion.2 runs the kernel of .1 (deduplicated); `out` has its own, only in PTX_NATIVE.
  by = {f["fusion"]: f["atomics"] for f in got["fusions"]}
  assert by["input_scatter_fusion.1"] == by["input_scatter_fusion.2"] == verdict
  assert by["out"] == ("native" if ptx is PTX_NATIVE else "not in PTX")


OVERLAP_HLO = """\
HloModule m, is_scheduled=true, num_partitions=2

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %e (p: f32[16], q: f32[16]) -> f32[16] {
  %p = f32[16]{0} parameter(0)
  %q = f32[16]{0} parameter(1)
  %ar-start = f32[16]{0} all-reduce-start(%p), channel_id=1, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%add
  %f1 = f32[16]{0} fusion(%q), kind=kLoop, calls=%add
  %b = f32[16]{0} bitcast(%f1)
  %f2 = f32[16]{0} fusion(%b), kind=kLoop, calls=%add
  %ar-done = f32[16]{0} all-reduce-done(%ar-start)
  %ag-start = (f32[16]{0}, f32[32]{0}) all-gather-start(%ar-done), channel_id=2, replica_groups={{0,1}}, dimensions={0}, use_global_device_ids=true
  %ag-done = f32[32]{0} all-gather-done(%ag-start)
  %sync = f32[16]{0} all-reduce(%f2), channel_id=3, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%add
  ROOT %r = f32[16]{0} add(%sync, %ar-done)
}
"""


def test_async_collectives_report_the_compute_scheduled_under_them():
  mesh = jax.sharding.AbstractMesh((2,), ("fsdp",))
  overlaps = sorted((c.kind, -1 if c.overlap is None else c.overlap) for c in hlo.collectives(OVERLAP_HLO, mesh))
  # Two fusions under the all-reduce (the bitcast is not compute), none under the gather, and the
  # synchronous all-reduce has no start/done at all (None).
  assert overlaps == [("all-gather", 0), ("all-reduce", -1), ("all-reduce", 2)]


# ------------------------------------------------------------------------------------------- xla_env

def test_ftz_atomics_flag_is_added_once_and_merged():
  flag = "--xla_backend_extra_options=-nvptx-allow-ftz-atomics"
  assert xla_env.with_ftz_atomics("") == flag
  assert xla_env.with_ftz_atomics("--xla_force_host_platform_device_count=8") == \
      "--xla_force_host_platform_device_count=8 " + flag
  merged = xla_env.with_ftz_atomics("--xla_backend_extra_options=-foo,-bar=1")
  assert merged == "--xla_backend_extra_options=-foo,-bar=1,-nvptx-allow-ftz-atomics"
  assert xla_env.has_ftz_atomics(merged) and xla_env.with_ftz_atomics(merged) == merged
  assert not xla_env.has_ftz_atomics("--xla_backend_extra_options=-foo")
  assert xla_env.without_ftz_atomics(merged) == "--xla_backend_extra_options=-foo,-bar=1"
  assert xla_env.without_ftz_atomics("--a=1 " + flag) == "--a=1"


@pytest.mark.parametrize("version, affected", [("0.10.1", False), ("0.10.2", True), ("0.11.0", True),
                                               ("0.11.1", False), ("0.11.2", False), ("0.10.2.dev20260101", True)])
def test_affected_jaxlib_versions(version, affected):
  assert xla_env.affected(version) == affected


def test_apply_after_the_backends_started_warns_on_cpu_and_never_sets(monkeypatch):
  """This test process's CPU backend is running: the flag could no longer take effect, so apply() says so
  instead of pretending (or raises, were the backend a GPU)."""
  jax.devices()
  monkeypatch.setattr(xla_env.importlib.metadata, "version", lambda name: "0.10.2")
  monkeypatch.setattr(xla_env, "cuda_plugin_installed", lambda: True)
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  with pytest.warns(RuntimeWarning, match="compare-and-swap loop"):
    assert xla_env.apply(env) == "too late"
  assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
  assert xla_env.apply({"XLA_FLAGS": xla_env.with_ftz_atomics("")}) == "present"
  assert xla_env.apply({"GEM_JAX_FTZ_ATOMICS": "0"}) == "off"
  monkeypatch.setattr(xla_env, "_backends_started", lambda: False)
  env = {}
  assert xla_env.apply(env) == "set" and xla_env.has_ftz_atomics(env["XLA_FLAGS"])
  monkeypatch.setattr(xla_env, "cuda_plugin_installed", lambda: False)
  assert xla_env.apply({}) == "not needed"


def test_a_cuda_plugin_without_a_driver_runs_on_the_cpu(monkeypatch):
  monkeypatch.setattr(xla_env, "cuda_plugin_installed", lambda: True)
  monkeypatch.setattr(xla_env, "_backends_started", lambda: False)
  monkeypatch.setattr(xla_env, "has_nvidia_driver", lambda: False)
  env = {}
  assert xla_env.cpu_without_driver(env) and env == {"JAX_PLATFORMS": "cpu"}
  assert not xla_env.cpu_without_driver({"JAX_PLATFORMS": "cuda"})   # the user's choice stands
  monkeypatch.setattr(xla_env, "has_nvidia_driver", lambda: True)
  assert not xla_env.cpu_without_driver({})


def test_compile_for_names_its_default_folder_after_the_target_and_the_overrides():
  from gem_jax.observe.gpu_compile import default_out
  plain = default_out("small", "meshes/h200_1.yaml")
  assert plain == os.path.join("runs", "compile_small_h200_1")
  other = default_out("small", "meshes/h200_1.yaml", "b200")
  assert other == os.path.join("runs", "compile_small_h200_1_b200")
  fp8 = default_out("small", "meshes/h200_1.yaml", None, ["model.precision.policy=fp8"])
  assert fp8.startswith(plain + "_") and len(fp8) == len(plain) + 9
  assert fp8 != default_out("small", "meshes/h200_1.yaml", None, ["model.precision.policy=bf16"])
  assert fp8 == default_out("small", "meshes/h200_1.yaml", None, ["model.precision.policy=fp8"])

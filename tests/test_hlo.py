"""Collectives and memory read from compiled HLO: kinds, bytes, mesh axes, conditional / loop placement,
the three replica-group forms, GPU async pairs, and the device-id convention (positions in mesh order).

Byte counts are worked by hand from the shapes: f32 = 4 B, bf16 = 2 B, f8 = 1 B. The 5-axis test mesh
is (replica, fsdp, sparse, context, tensor) = (2, 2, 2, 1, 1), so position i = 4*replica + 2*fsdp + sparse.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gem_jax.observe import hlo

AXES = ("replica", "fsdp", "sparse", "context", "tensor")


def make_mesh(order=range(8)) -> Mesh:
  return Mesh(np.array(jax.devices())[list(order)].reshape(2, 2, 2, 1, 1), AXES)


@pytest.fixture(scope="module")
def mesh():
  return make_mesh()


def compile_shard_map(mesh, f, in_spec, out_spec, x):
  # check_vma=False: these tests read the HLO of known collectives, not jax's replication checks.
  g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=False))
  return g.lower(jax.device_put(x, NamedSharding(mesh, in_spec))).compile()


def only(colls, kind=None):
  picked = [c for c in colls if kind is None or c.kind == kind]
  assert len(picked) == 1, colls
  return picked[0]


X_8x16 = jnp.arange(128, dtype=jnp.float32).reshape(8, 16)


# ------------------------------------------------------------------------------ shard_map collectives

def test_all_gather_over_fsdp(mesh):
  c = compile_shard_map(mesh, lambda a: lax.all_gather(a, "fsdp", tiled=True), P("fsdp"), P(), X_8x16)
  ag = only(hlo.collectives(c.as_text(), mesh))
  # local f32[4,16] = 256 B gathered to f32[8,16] = 512 B; half of it comes from the peer.
  assert (ag.kind, ag.operand_bytes, ag.result_bytes, ag.group_size) == ("all-gather", 256, 512, 2)
  assert ag.axes == ("fsdp",) and ag.moved_bytes == 256.0
  assert "all_gather" in ag.op_name and not ag.conditional and ag.count == 1


def test_psum_over_replica_and_sparse(mesh):
  c = compile_shard_map(mesh, lambda a: lax.psum(a, ("replica", "sparse")), P(("replica", "sparse")),
                        P(), X_8x16)
  ar = only(hlo.collectives(c.as_text(), mesh))
  # local f32[2,16] = 128 B over groups of 4: 2 * 128 * 3/4.
  assert (ar.kind, ar.operand_bytes, ar.group_size, ar.axes) == ("all-reduce", 128, 4, ("replica", "sparse"))
  assert ar.moved_bytes == 192.0


def test_psum_scatter_and_all_to_all_over_sparse(mesh):
  c = compile_shard_map(mesh, lambda a: lax.psum_scatter(a, "sparse", tiled=True), P(), P("sparse"), X_8x16)
  rs = only(hlo.collectives(c.as_text(), mesh))
  assert (rs.kind, rs.operand_bytes, rs.result_bytes, rs.axes) == ("reduce-scatter", 512, 256, ("sparse",))
  assert rs.moved_bytes == 256.0
  c = compile_shard_map(mesh, lambda a: lax.all_to_all(a, "sparse", 0, 1, tiled=True), P("sparse"),
                        P(None, "sparse"), X_8x16)
  a2a = only(hlo.collectives(c.as_text(), mesh))
  # local f32[4,16] = 256 B split in two; one half stays.
  assert (a2a.kind, a2a.operand_bytes, a2a.group_size, a2a.axes) == ("all-to-all", 256, 2, ("sparse",))
  assert a2a.moved_bytes == 128.0


def test_ppermute_pairs_and_rings(mesh):
  c = compile_shard_map(mesh, lambda a: lax.ppermute(a, "fsdp", [(0, 1), (1, 0)]), P("fsdp"), P("fsdp"),
                        X_8x16)
  cp = only(hlo.collectives(c.as_text(), mesh))
  assert (cp.kind, cp.operand_bytes, cp.group_size, cp.axes, cp.moved_bytes) == (
      "collective-permute", 256, 2, ("fsdp",), 256.0)
  ring = [(i, (i + 1) % 4) for i in range(4)]
  c = compile_shard_map(mesh, lambda a: lax.ppermute(a, ("replica", "fsdp"), ring), P(("replica", "fsdp")),
                        P(("replica", "fsdp")), X_8x16)
  cp = only(hlo.collectives(c.as_text(), mesh))
  assert (cp.operand_bytes, cp.group_size, cp.axes, cp.moved_bytes) == (128, 4, ("replica", "fsdp"), 128.0)


def test_cond_loop_and_summary(mesh):
  def f(a):
    g = lax.all_gather(a, "fsdp", tiled=True)                 # f32[4,16] -> [8,16]: moves 256 B
    s = lax.psum(a, ("replica", "sparse"))                    # 2 * 256 * 3/4 = 384 B
    loop = lax.fori_loop(0, 3, lambda i, c: lax.psum(c, "sparse") * 0.5, a)   # 3 x 256 B
    branch = lax.cond(a.sum() > 0, lambda b: lax.psum(b, "replica"), lambda b: b * 2.0, a)  # 256 B, maybe
    return g.sum() + s.sum() + loop.sum() + branch.sum()
  c = compile_shard_map(mesh, f, P("fsdp"), P(), X_8x16)
  colls = hlo.collectives(c.as_text(), mesh)
  assert sorted((x.kind, x.axes, x.count, x.conditional) for x in colls) == sorted([
      ("all-gather", ("fsdp",), 1, False), ("all-reduce", ("replica", "sparse"), 1, False),
      ("all-reduce", ("sparse",), 3, False), ("all-reduce", ("replica",), 1, True)])
  assert {x.computation for x in colls if x.conditional} != {x.computation for x in colls if x.count == 3}
  assert hlo.summarize(colls) == {
      "by_kind": {"all-gather": 256.0, "all-reduce": 384.0 + 3 * 256.0},
      "by_axis": {"fsdp": 256.0, "replica,sparse": 384.0, "sparse": 768.0}, "total": 1408.0}
  full = hlo.summarize(colls, include_conditional=True)
  assert full["by_axis"]["replica"] == 256.0 and full["total"] == 1664.0
  assert [x.axes for x in hlo.select(colls, "cond")] == [("replica",)]
  assert len(hlo.select(colls, "psum", exclude="cond")) == 2


def test_device_ids_are_positions_in_mesh_order(mesh):
  """A mesh over permuted devices compiles to the same HLO: replica-group ids are positions in
  mesh.devices.flat, not device ids. Read as device ids, the fsdp groups {0,2},... would become
  {3,6},... here, which the attribution would call (replica, sparse)."""
  permuted = make_mesh([3, 1, 6, 0, 7, 2, 5, 4])

  def f(a):
    return lax.all_gather(a, "fsdp", tiled=True).sum() + lax.psum(a, "sparse").sum()
  texts = [compile_shard_map(m, f, P(("fsdp", "sparse")), P(), X_8x16).as_text() for m in (mesh, permuted)]
  assert "replica_groups={{0,2},{1,3},{4,6},{5,7}}" in texts[1]
  got = hlo.collectives(texts[1], permuted)
  assert sorted(x.axes for x in got) == [("fsdp",), ("sparse",)]
  assert got == hlo.collectives(texts[0], mesh)


def test_partitioner_collectives_in_iota_and_mesh_forms(mesh):
  # Collectives the SPMD partitioner inserts: XLA:CPU (jax 0.10.2) prints these groups in the iota
  # and the mesh-axes forms; whatever the form, the axes must come out right.
  cases = [(P("fsdp"), P(), "all-gather", ("fsdp",)),
           (P(("replica", "sparse")), P(), "all-gather", ("replica", "sparse")),
           (P(("fsdp", "replica")), P("replica"), "all-gather", ("fsdp",))]
  for spec_in, spec_out, kind, axes in cases:
    x = jax.device_put(X_8x16, NamedSharding(mesh, spec_in))
    scaled = jax.jit(lambda v: v * 2.0, out_shardings=NamedSharding(mesh, spec_out))
    text = scaled.lower(x).compile().as_text()
    assert only(hlo.collectives(text, mesh), kind).axes == axes, text
  # The last case also swaps shards between replica and fsdp: f32[2,16] crosses both axes.
  cp = only(hlo.collectives(text, mesh), "collective-permute")
  assert (cp.axes, cp.group_size, cp.moved_bytes) == (("replica", "fsdp"), 4, 128.0)


# ----------------------------------------------------------------------------- parsers on fixed text

@pytest.mark.parametrize("text, groups", [
    ("{{0,2},{1,3}}, dimensions={0}", [[0, 2], [1, 3]]),
    ("{}", None),
    ("[4,2]<=[8]", [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ("[2,4]<=[4,2]T(1,0), use_global_device_ids=true", [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("[4,2]<=[2,2,2]T(0,2,1)", [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ("mesh['axis_0'=2,'axis_1'=1,'axis_2'=4], device_ids=([2,2,2]T(1,0,2)) {'axis_0'}, dimensions={0}",
     [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ("mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}",
     [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("mesh['a'=2,'b'=4] {'a'}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("mesh['a'=2,'b'=4] {'a','b'}", [list(range(8))]),
    ("mesh['a'=8] {'a':(2)2}", [[0, 2], [1, 3], [4, 6], [5, 7]]),   # middle piece of a=[2,2,2]
    ("mesh['a'=8] {'a':(1)2}", [[0, 4], [1, 5], [2, 6], [3, 7]]),   # major piece of a=[2,4]
    ("mesh['a'=8] {'a':(4)2}", [[0, 1], [2, 3], [4, 5], [6, 7]]),   # minor piece of a=[4,2]
])
def test_parse_replica_groups(text, groups):
  assert hlo.parse_replica_groups(text) == groups


def test_parse_replica_groups_rejects_unknown_form():
  with pytest.raises(ValueError, match="replica_groups"):
    hlo.parse_replica_groups("groups(0,1)")


def test_shape_bytes():
  assert hlo.shape_bytes("f32[64,4]{1,0}") == 1024
  assert hlo.shape_bytes("bf16[3,5]") == 30 and hlo.shape_bytes("s32[]") == 4
  assert hlo.shape_bytes("pred[7]{0}") == 7 and hlo.shape_bytes("f8e4m3fn[16]{0}") == 16
  assert hlo.shape_bytes("(f32[2]{0}, (bf16[4]{0}, u8[3]))") == 19
  assert hlo.shape_bytes("s4[8]{0:E(4)}") == 4 and hlo.shape_bytes("f32[<=8,2]") == 64
  with pytest.raises(ValueError, match="q7"):
    hlo.shape_bytes("q7[2]")


GPU_HLO = """\
HloModule jit_step, is_scheduled=true, entry_computation_layout={(bf16[4,64]{1,0})->bf16[8,64]{1,0}}, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%a2a_computation (p0: bf16[8,32]) -> bf16[8,32] {
  %p0 = bf16[8,32]{1,0} parameter(0)
  ROOT %a2a = bf16[8,32]{1,0} all-to-all(%p0), channel_id=7, replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}
}

%body (carry: (s32[], f32[16])) -> (s32[], f32[16]) {
  %carry = (s32[], f32[16]{0}) parameter(0)
  %i = s32[] get-tuple-element(%carry), index=0
  %v = f32[16]{0} get-tuple-element(%carry), index=1
  %ar-start = f32[16]{0} all-reduce-start(%v), channel_id=3, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(step)/while/body/psum"}
  %ar-done = f32[16]{0} all-reduce-done(%ar-start)
  ROOT %t = (s32[], f32[16]{0}) tuple(%i, %ar-done)
}

%cond (carry.1: (s32[], f32[16])) -> pred[] {
  %carry.1 = (s32[], f32[16]{0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

%helper (ph: f8e4m3fn[64]) -> f8e4m3fn[128] {
  %ph = f8e4m3fn[64]{0} parameter(0)
  ROOT %ag-in-branch = f8e4m3fn[128]{0} all-gather(%ph), channel_id=6, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}, use_global_device_ids=true
}

%on_true (pt: f8e4m3fn[64]) -> f8e4m3fn[64] {
  %pt = f8e4m3fn[64]{0} parameter(0)
  %h = f8e4m3fn[128]{0} call(%pt), to_apply=%helper
  %cp-start = (f8e4m3fn[64]{0}, f8e4m3fn[64]{0}, u32[], u32[]) collective-permute-start(%pt), channel_id=5, source_target_pairs={{0,1},{1,0}}, metadata={op_name="jit(step)/cond/ppermute"}
  ROOT %cp-done = f8e4m3fn[64]{0} collective-permute-done(%cp-start)
}

%on_false (pf: f8e4m3fn[64]) -> f8e4m3fn[64] {
  %pf = f8e4m3fn[64]{0} parameter(0)
  ROOT %neg = f8e4m3fn[64]{0} negate(%pf)
}

ENTRY %main.1_spmd (p: bf16[4,64], r: f32[4,4], s2: bf16[8], s: bf16[8,32], f: f8e4m3fn[64], b: pred[], init: (s32[], f32[16])) -> bf16[8,64] {
  %p = bf16[4,64]{1,0} parameter(0)
  %r = f32[4,4]{1,0} parameter(1)
  %s2 = bf16[8]{0} parameter(2)
  %s = bf16[8,32]{1,0} parameter(3)
  %f = f8e4m3fn[64]{0} parameter(4)
  %b = pred[] parameter(5)
  %init = (s32[], f32[16]{0}) parameter(6)
  %ag-start = (bf16[4,64]{1,0}, bf16[8,64]{1,0}) all-gather-start(%p), channel_id=1, replica_groups=[4,2]<=[2,2,2]T(0,2,1), dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(step)/all_gather"}
  %ag-done = bf16[8,64]{1,0} all-gather-done(%ag-start)
  %ar2 = (f32[4,4]{1,0}, bf16[8]{0}) all-reduce-start(f32[4,4]{1,0} %r, bf16[8]{0} %s2), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %ar2-done = (f32[4,4]{1,0}, bf16[8]{0}) all-reduce-done(%ar2)
  %a2a-start = ((bf16[8,32]{1,0}), bf16[8,32]{1,0}) all-to-all-start(%s), channel_id=4, replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}
  %a2a-done = bf16[8,32]{1,0} all-to-all-done(%a2a-start)
  %async-start = ((bf16[8,32]{1,0}), bf16[8,32]{1,0}, s32[]) async-start(%s), calls=%a2a_computation
  %async-done = bf16[8,32]{1,0} async-done(%async-start), calls=%a2a_computation
  %w = (s32[], f32[16]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %c = f8e4m3fn[64]{0} conditional(%b, %f, %f), true_computation=%on_true, false_computation=%on_false
  ROOT %out = bf16[8,64]{1,0} copy(%ag-done)
}
"""


def test_gpu_async_forms_count_once(mesh):
  colls = {(c.kind, c.computation): c for c in hlo.collectives(GPU_HLO, mesh)}
  assert len(colls) == 7, colls
  ag = colls[("all-gather", "main.1_spmd")]
  assert (ag.operand_bytes, ag.result_bytes, ag.axes, ag.moved_bytes) == (512, 1024, ("fsdp",), 512.0)
  combined = colls[("all-reduce", "main.1_spmd")]     # f32[4,4] + bf16[8] = 64 + 16 B over all 8
  assert (combined.operand_bytes, combined.group_size, combined.moved_bytes) == (80, 8, 140.0)
  assert combined.axes == ("replica", "fsdp", "sparse")
  sugar, wrapped = colls[("all-to-all", "main.1_spmd")], colls[("all-to-all", "a2a_computation")]
  for a2a in (sugar, wrapped):
    assert (a2a.operand_bytes, a2a.result_bytes, a2a.axes, a2a.moved_bytes, a2a.count) == (
        512, 512, ("sparse",), 256.0, 1)
  looped = colls[("all-reduce", "body")]
  assert (looped.count, looped.axes, looped.moved_bytes) == (4, ("fsdp", "sparse"), 96.0)
  cp = colls[("collective-permute", "on_true")]
  assert (cp.conditional, cp.operand_bytes, cp.result_bytes, cp.axes) == (True, 64, 64, ("sparse",))
  nested = colls[("all-gather", "helper")]          # called from a branch: conditional too
  assert (nested.conditional, nested.axes, nested.moved_bytes) == (True, ("replica",), 64.0)
  assert hlo.summarize(list(colls.values()))["total"] == 512 + 140 + 256 + 256 + 4 * 96
  assert hlo.summarize(list(colls.values()), include_conditional=True)["by_kind"]["collective-permute"] == 64


ADD = "%add (x: f32[], y: f32[]) -> f32[] {\n  %x = f32[] parameter(0)\n  %y = f32[] parameter(1)\n" \
      "  ROOT %s = f32[] add(%x, %y)\n}\n"


def one_all_reduce(header: str, attrs: str) -> str:
  return (f"HloModule m, {header}\n{ADD}ENTRY %e (x: f32[10]) -> f32[10] {{\n  %x = f32[10]{{0}} parameter(0)\n"
          f"  ROOT %ar = f32[10]{{0}} all-reduce(%x), {attrs}, to_apply=%add\n}}\n")


def test_group_modes_without_global_ids(mesh):
  # No channel id: cross-replica, and with one replica every device reduces with itself.
  ar = only(hlo.collectives(one_all_reduce("num_partitions=8", "replica_groups={}"), mesh))
  assert (ar.axes, ar.group_size, ar.moved_bytes) == ((), 1, 0.0)
  assert hlo.summarize([ar]) == {"by_kind": {"all-reduce": 0.0}, "by_axis": {}, "total": 0.0}
  # Channel id without use_global_device_ids: cross-replica-and-partition, replica 0's 8 partitions.
  ar = only(hlo.collectives(one_all_reduce("num_partitions=8", "channel_id=1, replica_groups={{0}}"), mesh))
  assert (ar.axes, ar.group_size, ar.moved_bytes) == (("replica", "fsdp", "sparse"), 8, 70.0)
  # A permute whose pairs all stay on their device moves nothing.
  text = one_all_reduce("num_partitions=8", "channel_id=1").replace(
      "all-reduce(%x), channel_id=1, to_apply=%add", "collective-permute(%x), channel_id=1, "
      "source_target_pairs={{0,0},{1,1},{2,2},{3,3},{4,4},{5,5},{6,6},{7,7}}")
  cp = only(hlo.collectives(text, mesh))
  assert (cp.kind, cp.axes, cp.group_size, cp.moved_bytes) == ("collective-permute", (), 1, 0.0)
  # pmap-style programs (several replicas) are refused rather than misread.
  with pytest.raises(ValueError, match="8 replica"):
    hlo.collectives(one_all_reduce("replica_count=8", "replica_groups={{0,4},{1,5},{2,6},{3,7}}"), mesh)


def test_ragged_all_to_all_counts_the_input_buffer(mesh):
  text = "HloModule m, num_partitions=8\nENTRY %e (a: bf16[16,8], o: bf16[16,8], k: s64[2]) -> bf16[16,8] {\n" \
         "  %a = bf16[16,8]{1,0} parameter(0)\n  %o = bf16[16,8]{1,0} parameter(1)\n" \
         "  %k = s64[2]{0} parameter(2)\n  ROOT %r = bf16[16,8]{1,0} ragged-all-to-all(%a, %o, %k, %k, %k, %k), " \
         "channel_id=9, replica_groups={{0,1},{2,3},{4,5},{6,7}}\n}\n"
  r = only(hlo.collectives(text, mesh))
  # Only the 256 B input buffer counts (not the output buffer or the offsets); half of it at most leaves.
  assert (r.kind, r.operand_bytes, r.result_bytes, r.axes, r.moved_bytes) == (
      "ragged-all-to-all", 256, 256, ("sparse",), 128.0)


def test_mesh_must_match_the_program(mesh):
  small = Mesh(np.array(jax.devices()[:4]), ("fsdp",))
  with pytest.raises(ValueError, match="expected 1 x 4"):
    hlo.collectives(GPU_HLO, small)


# ------------------------------------------------------------------------------------------- memory

def test_memory_on_cpu():
  x = jnp.ones((64, 64), jnp.float32)
  compiled = jax.jit(lambda a: jnp.tanh(a @ a) @ a + 1.0).lower(x).compile()
  mem = hlo.memory(compiled)
  assert mem["argument"] == 64 * 64 * 4 and mem["output"] == 64 * 64 * 4 and mem["temp"] > 0
  assert mem["peak_estimate"] == mem["argument"] + mem["output"] + mem["temp"] - mem["alias"]


def test_memory_without_analysis_is_empty():
  class NoStats:
    def memory_analysis(self):
      return None

  class Raises:
    def memory_analysis(self):
      raise NotImplementedError

  class Partial:
    def memory_analysis(self):
      return type("S", (), {"argument_size_in_bytes": 4})()
  assert hlo.memory(NoStats()) == {} and hlo.memory(Raises()) == {} and hlo.memory(Partial()) == {}

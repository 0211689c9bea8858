// HSTU attention over jagged rows on the CPU: an XLA FFI custom call (forward, and a backward giving dq, dk, dv
// and the bias gradient per distance). The math is reference.py's; cpu.py builds this file, registers it and
// wraps it in a custom_vjp.
//
// Why C++: the tiled XLA loop (tiled.py) spends most of its time on per-step costs XLA:CPU cannot remove (the
// loop, gathers, scatters, small dots through the generic emitter). Here one work item is a whole (row, head):
// its keys, values and (backward) queries are packed once into contiguous panels, and every product runs
// through one register-blocked micro-kernel (8 rows x 32 columns of f32 accumulators). Items own disjoint
// outputs (a row's tokens of one head), so the items are shared out among XLA's intra-op threads with no
// locking. The bias gradient is summed per item and the items' sums are added up in row order at the end, so
// every number is the same whatever thread took which item (a resumed run repeats a run bit for bit).
//
// Letters: T token capacity, H heads, D q/k width, Dv value width, N max_seq_len (rows are used up to N
// tokens; tokens past it, and slots past offsets[B], get zeros), n a row's used length, np = n rounded up to
// 16, Dp / Dvp = D / Dv rounded up to 16.
// This file must never allocate per pair or per tile on the heap in the loops, nor read past a row's tokens.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16 __attribute__((vector_size(64)));

constexpr int kLanes = 16;
constexpr int kQueryBlock = 64;  // forward: queries per block of logits
constexpr int kKeyBlock = 64;    // backward: keys per block of (transposed) logits

inline int Round16(int n) { return (n + kLanes - 1) / kLanes * kLanes; }
inline v16 Load(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline void Store(float* p, v16 x) { *reinterpret_cast<v16u*>(p) = x; }
inline v16 Splat(float x) { return v16{} + x; }
inline i16 SplatI(int32_t x) { return i16{} + x; }

// ---------------------------------------------------------------------------------------------------------
// C[m x n] (+)= A[m x k] B[k x n], row-major; n a multiple of 16 (B's and C's panels are padded to it).

template <int MR, int NV>
void Micro(int k, const float* a, long lda, const float* b, long ldb, float* c, long ldc, bool accumulate) {
  v16 acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[r][v] = accumulate ? Load(c + r * ldc + v * kLanes) : v16{};
  for (int p = 0; p < k; ++p) {
    v16 bv[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) bv[v] = Load(b + p * ldb + v * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const float x = a[r * lda + p];
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[r][v] += x * bv[v];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) Store(c + r * ldc + v * kLanes, acc[r][v]);
}

using MicroFn = void (*)(int, const float*, long, const float*, long, float*, long, bool);

template <int MR>
constexpr MicroFn kMicro[2] = {Micro<MR, 1>, Micro<MR, 2>};

constexpr int kRows = 8;
const MicroFn* const kMicroByRows[kRows + 1] = {nullptr,   kMicro<1>, kMicro<2>, kMicro<3>, kMicro<4>,
                                                kMicro<5>, kMicro<6>, kMicro<7>, kMicro<8>};

void Gemm(int m, int n, int k, const float* a, long lda, const float* b, long ldb, float* c, long ldc,
          bool accumulate) {
  for (int j = 0; j < n; j += 2 * kLanes) {
    const int nv = std::min(2, (n - j) / kLanes);
    for (int i = 0; i < m; i += kRows) {
      const int rows = std::min(kRows, m - i);
      kMicroByRows[rows][nv - 1](k, a + i * lda, lda, b + j, ldb, c + i * ldc + j, ldc, accumulate);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// exp and the SiLU's sigmoid, 16 lanes at a time (Cephes' expf polynomial; within 2 ulp of expf).

inline v16 Exp(v16 x) {
  x = x < Splat(-87.3f) ? Splat(-87.3f) : x;
  x = x > Splat(88.3f) ? Splat(88.3f) : x;
  const v16 magic = Splat(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const v16 n = (x * 1.44269504088896341f + magic) - magic;
  const v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  v16 p = Splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const i16 bits = (__builtin_convertvector(n, i16) + 127) << 23;
  return p * (v16)bits;  // a vector cast between same-size vectors keeps the bits
}

// ---------------------------------------------------------------------------------------------------------
// The mask and positions of reference.py, for one token i against 16 tokens j (or 16 tokens i against one j).

struct Row {
  int n;        // tokens used (the row's length clipped to N)
  int max_pos;  // M: the row's length - (c - 1 if c > 0) - its targets
};

struct Static {
  int n_max;        // N
  float alpha;
  bool causal;
  bool has_targets;
  int max_attn_len;  // w
  int contextual;    // c
  bool has_bias;
};

inline i16 Position(i16 idx, const Static& s, const Row& row) {
  i16 p = idx;
  if (s.contextual > 0) {
    p = idx - (s.contextual - 1);
    p = p < 0 ? SplatI(0) : p;
  }
  if (s.has_targets) p = p > row.max_pos ? SplatI(row.max_pos) : p;
  return p;
}

// (mask, d = p(i) - p(j)) for 16 query/key index pairs.
inline i16 Mask(i16 i, i16 j, const Static& s, const Row& row, i16* d_out) {
  const i16 p_i = Position(i, s, row), p_j = Position(j, s, row);
  const i16 d = p_i - p_j;
  *d_out = d;
  const i16 in_row = (i < row.n) & (j < row.n);
  if (!s.causal) return in_row;
  i16 m = (i == j) | (d > 0);
  if (s.max_attn_len > 0) m &= d <= s.max_attn_len;
  if (s.contextual > 0) m |= (p_i == 0) & (p_j < row.max_pos);
  return m & in_row;
}

// The bias of 16 pairs: bias_h[min(|d|, N - 1)] (masked pairs read a clipped slot and are zeroed later).
inline v16 Bias(const float* bias_h, i16 d, int n_max) {
  d = d < 0 ? -d : d;
  d = d > n_max - 1 ? SplatI(n_max - 1) : d;
  v16 out;
  for (int l = 0; l < kLanes; ++l) out[l] = bias_h[d[l]];
  return out;
}

const i16 kIota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

// ---------------------------------------------------------------------------------------------------------
// Arguments of one call, and per-thread scratch.

struct Call {
  Static s;
  int num_tokens, num_rows, heads, d, dv;
  const float *q, *k, *v, *dout, *bias;
  const int32_t *offsets, *targets;
  float *out, *dq, *dk, *dv_out;
  float* dbias_items;  // one N + 16 bias gradient per (row, head) item (backward)
  long bias_stride;    // N + 16
};

Row RowOf(const Call& c, int b) {
  const int len = c.offsets[b + 1] - c.offsets[b];
  const int t = c.s.has_targets ? c.targets[b] : 0;
  const int ctx = c.s.contextual;
  return Row{std::max(0, std::min(len, c.s.n_max)), len - (ctx > 0 ? ctx - 1 : 0) - t};
}

struct Scratch {
  std::vector<float> buf;
  float* Take(size_t n, size_t* used) {
    float* p = buf.data() + *used;
    *used += n;
    return p;
  }
};

thread_local Scratch scratch;

// src rows [0, n) of width w at stride ld into dst (rows x wp), zero-padded to rows and wp columns.
void PackRows(const float* src, long ld, int n, int w, float* dst, int rows, int wp) {
  for (int r = 0; r < rows; ++r) {
    float* o = dst + (long)r * wp;
    if (r < n) {
      std::memcpy(o, src + r * ld, w * sizeof(float));
      std::fill(o + w, o + wp, 0.0f);
    } else {
      std::fill(o, o + wp, 0.0f);
    }
  }
}

// The transpose: dst (w x cols) with dst[x][r] = src[r][x] for r < n, zero for n <= r < cols.
void PackCols(const float* src, long ld, int n, int w, float* dst, int cols) {
  for (int x = 0; x < w; ++x) {
    float* o = dst + (long)x * cols;
    for (int r = 0; r < n; ++r) o[r] = src[r * ld + x];
    std::fill(o + n, o + cols, 0.0f);
  }
}

// The key range [lo, hi) that queries [q0, q0 + qn) of a row can see, lo a multiple of 16 (a superset, as in
// tiled._key_block_range).
void KeyRange(const Static& s, const Row& row, int q0, int qn, int* lo, int* hi) {
  *lo = 0;
  *hi = row.n;
  if (!s.causal) return;
  const int c = s.contextual;
  if (c > 0 && q0 < c) return;  // contextual queries see every history key
  *hi = q0 + qn;                // others see keys j <= i only (p is non-decreasing)
  if (s.max_attn_len > 0) {
    int p = q0;
    if (c > 0) p = std::max(q0 - (c - 1), 0);
    if (s.has_targets) p = std::min(p, row.max_pos);
    const int p_lo = p - s.max_attn_len;
    *lo = p_lo > 0 ? (p_lo + (c > 0 ? c - 1 : 0)) / kLanes * kLanes : 0;
  }
}

// ---------------------------------------------------------------------------------------------------------
// Forward of one (row, head).

void ForwardItem(const Call& c, int b, int h) {
  const Static& s = c.s;
  const Row row = RowOf(c, b);
  const int n = row.n;
  if (n <= 0) return;
  const int np = Round16(n), dvp = Round16(c.dv);
  const long ldq = (long)c.heads * c.d, ldv = (long)c.heads * c.dv;
  const long start = c.offsets[b];
  const float* q = c.q + start * ldq + h * c.d;
  const float* k = c.k + start * ldq + h * c.d;
  const float* v = c.v + start * ldv + h * c.dv;
  const float* bias_h = s.has_bias ? c.bias + (long)h * s.n_max : nullptr;
  const float inv_n = 1.0f / s.n_max;

  size_t need = (size_t)c.d * np + (size_t)np * dvp + (size_t)kQueryBlock * np + (size_t)kQueryBlock * dvp;
  if (scratch.buf.size() < need) scratch.buf.resize(need);
  size_t used = 0;
  float* kt = scratch.Take((size_t)c.d * np, &used);      // D x np
  float* vp = scratch.Take((size_t)np * dvp, &used);      // np x Dvp
  float* w = scratch.Take((size_t)kQueryBlock * np, &used);  // logits, then weights: block x keys
  float* o = scratch.Take((size_t)kQueryBlock * dvp, &used);
  PackCols(k, ldq, n, c.d, kt, np);
  PackRows(v, ldv, n, c.dv, vp, np, dvp);

  for (int q0 = 0; q0 < n; q0 += kQueryBlock) {
    const int qn = std::min(kQueryBlock, n - q0);
    int lo, hi;
    KeyRange(s, row, q0, qn, &lo, &hi);
    const int kw = Round16(hi) - lo;
    Gemm(qn, kw, c.d, q + q0 * ldq, ldq, kt + lo, np, w, kw, false);
    for (int r = 0; r < qn; ++r) {
      float* wr = w + (long)r * kw;
      const i16 i = SplatI(q0 + r);
      for (int j0 = 0; j0 < kw; j0 += kLanes) {
        i16 d;
        const i16 m = Mask(i, kIota + (lo + j0), s, row, &d);
        v16 l = Load(wr + j0) * s.alpha;
        if (bias_h) l += Bias(bias_h, d, s.n_max);
        const v16 sig = 1.0f / (1.0f + Exp(-l));
        Store(wr + j0, m != 0 ? l * sig * inv_n : v16{});
      }
    }
    Gemm(qn, dvp, kw, w, kw, vp + (long)lo * dvp, dvp, o, dvp, false);
    float* out = c.out + (start + q0) * ldv + h * c.dv;
    for (int r = 0; r < qn; ++r) std::memcpy(out + r * ldv, o + (long)r * dvp, c.dv * sizeof(float));
  }
}

// ---------------------------------------------------------------------------------------------------------
// Backward of one (row, head): per block of keys, the transposed logits against every query that can see them.

void BackwardItem(const Call& c, int b, int h) {
  const Static& s = c.s;
  const Row row = RowOf(c, b);
  const int n = row.n;
  if (n <= 0) return;
  const int np = Round16(n), dp = Round16(c.d), dvp = Round16(c.dv);
  const long ldq = (long)c.heads * c.d, ldv = (long)c.heads * c.dv;
  const long start = c.offsets[b];
  const float* q = c.q + start * ldq + h * c.d;
  const float* k = c.k + start * ldq + h * c.d;
  const float* v = c.v + start * ldv + h * c.dv;
  const float* dout = c.dout + start * ldv + h * c.dv;
  const float* bias_h = s.has_bias ? c.bias + (long)h * s.n_max : nullptr;
  float* dbias_h = s.has_bias ? c.dbias_items + ((long)b * c.heads + h) * c.bias_stride : nullptr;
  const float inv_n = 1.0f / s.n_max;
  // The distance is i - j where no contextual token or shared target position bends it: the bias gradient of
  // a key's row of pairs is then one contiguous run of distances.
  const bool plain = s.contextual == 0 && !s.has_targets;

  const size_t need = (size_t)c.d * np + (size_t)c.dv * np + (size_t)np * dvp + 3 * (size_t)np * dp +
                      3 * (size_t)kKeyBlock * np + (size_t)kKeyBlock * (dp + dvp);
  if (scratch.buf.size() < need) scratch.buf.resize(need);
  size_t used = 0;
  float* qt = scratch.Take((size_t)c.d * np, &used);        // D x np
  float* dot = scratch.Take((size_t)c.dv * np, &used);      // Dv x np
  float* dop = scratch.Take((size_t)np * dvp, &used);       // np x Dvp
  float* qp = scratch.Take((size_t)np * dp, &used);         // np x Dp
  float* kp = scratch.Take((size_t)np * dp, &used);         // np x Dp
  float* dq = scratch.Take((size_t)np * dp, &used);         // np x Dp, summed over key blocks
  float* wt = scratch.Take((size_t)kKeyBlock * np, &used);  // keys x queries: logits, then weights
  float* dwt = scratch.Take((size_t)kKeyBlock * np, &used); // keys x queries: dL/dw, then alpha dL/dlogits
  float* ds = scratch.Take((size_t)kKeyBlock * np, &used);  // queries x keys: alpha dL/dlogits
  float* dkb = scratch.Take((size_t)kKeyBlock * dp, &used);
  float* dvb = scratch.Take((size_t)kKeyBlock * dvp, &used);
  PackCols(q, ldq, n, c.d, qt, np);
  PackCols(dout, ldv, n, c.dv, dot, np);
  PackRows(dout, ldv, n, c.dv, dop, np, dvp);
  PackRows(q, ldq, n, c.d, qp, np, dp);
  PackRows(k, ldq, n, c.d, kp, np, dp);
  std::fill(dq, dq + (size_t)np * dp, 0.0f);

  for (int k0 = 0; k0 < n; k0 += kKeyBlock) {
    const int kn = std::min(kKeyBlock, n - k0);
    // Queries that can see keys [k0, k0 + kn): i >= k0 for a causal mask, plus the contextual ones.
    int ranges[2][2] = {{0, np}, {0, 0}};
    if (s.causal) {
      ranges[0][0] = k0;
      if (s.contextual > 0) {
        const int ctx_end = Round16(std::min(s.contextual, k0));
        if (ctx_end >= k0) {
          ranges[0][0] = 0;
        } else if (ctx_end > 0) {
          ranges[1][0] = 0;
          ranges[1][1] = ctx_end;
        }
      }
    }
    for (int part = 0; part < 2; ++part) {
      const int qlo = ranges[part][0], qw = ranges[part][1] - qlo;
      if (qw <= 0) continue;
      const bool more = part > 0;  // the second query range adds to the first's dk and dv
      Gemm(kn, qw, c.d, k + k0 * ldq, ldq, qt + qlo, np, wt, qw, false);
      Gemm(kn, qw, c.dv, v + k0 * ldv, ldv, dot + qlo, np, dwt, qw, false);
      for (int r = 0; r < kn; ++r) {
        float* wr = wt + (long)r * qw;
        float* dwr = dwt + (long)r * qw;
        const int j = k0 + r;
        for (int i0 = 0; i0 < qw; i0 += kLanes) {
          i16 d;
          const i16 m = Mask(kIota + (qlo + i0), SplatI(j), s, row, &d);
          v16 l = Load(wr + i0) * s.alpha;
          if (bias_h) l += Bias(bias_h, d, s.n_max);
          const v16 sig = 1.0f / (1.0f + Exp(-l));
          const v16 w = m != 0 ? l * sig * inv_n : v16{};
          const v16 dl = m != 0 ? Load(dwr + i0) * sig * (1.0f + l * (1.0f - sig)) * inv_n : v16{};
          Store(wr + i0, w);
          Store(dwr + i0, dl * s.alpha);
          if (!dbias_h) continue;
          const int d0 = qlo + i0 - j;
          if (plain && d0 >= 0) {  // distances d0 .. d0 + 15, all inside the N + 16 slots
            Store(dbias_h + d0, Load(dbias_h + d0) + dl);
          } else {
            for (int l2 = 0; l2 < kLanes; ++l2) {
              int dd = d[l2] < 0 ? -d[l2] : d[l2];
              dbias_h[std::min(dd, s.n_max - 1)] += dl[l2];
            }
          }
        }
      }
      // dv = w^T dout and dk = alpha dl^T q over these queries; dq += alpha dl k.
      Gemm(kn, dvp, qw, wt, qw, dop + (long)qlo * dvp, dvp, dvb, dvp, more);
      Gemm(kn, dp, qw, dwt, qw, qp + (long)qlo * dp, dp, dkb, dp, more);
      const int knp = Round16(kn);
      for (int i = 0; i < qw; ++i)
        for (int r = 0; r < knp; ++r) ds[(long)i * knp + r] = r < kn ? dwt[(long)r * qw + i] : 0.0f;
      Gemm(qw, dp, knp, ds, knp, kp + (long)k0 * dp, dp, dq + (long)qlo * dp, dp, true);
    }
    float* dk = c.dk + (start + k0) * ldq + h * c.d;
    float* dv = c.dv_out + (start + k0) * ldv + h * c.dv;
    for (int r = 0; r < kn; ++r) {
      std::memcpy(dk + r * ldq, dkb + (long)r * dp, c.d * sizeof(float));
      std::memcpy(dv + r * ldv, dvb + (long)r * dvp, c.dv * sizeof(float));
    }
  }
  float* dqo = c.dq + start * ldq + h * c.d;
  for (int i = 0; i < n; ++i) std::memcpy(dqo + i * ldq, dq + (long)i * dp, c.d * sizeof(float));
}

// ---------------------------------------------------------------------------------------------------------
// Work sharing: items (row, head), longest rows first, taken from a counter by the calling thread and by
// tasks on XLA's intra-op pool. A task the pool starts late finds no item left; the state it reads is kept
// alive by its shared_ptr, never the call's buffers.

struct Work {
  std::vector<int> order;  // b * H + h, longest rows first
  std::atomic<int> next{0};
  std::atomic<int> done{0};
  std::mutex mu;
  std::condition_variable all_done;
};

int Workers(ffi::ThreadPool& pool, int items) {
  return (int)std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), items));
}

template <typename F>
void Run(ffi::ThreadPool& pool, const Call& c, F&& item) {
  auto work = std::make_shared<Work>();
  work->order.resize((size_t)c.num_rows * c.heads);
  std::iota(work->order.begin(), work->order.end(), 0);
  std::vector<int> len(c.num_rows);
  for (int b = 0; b < c.num_rows; ++b) len[b] = RowOf(c, b).n;
  std::stable_sort(work->order.begin(), work->order.end(),
                   [&](int x, int y) { return len[x / c.heads] > len[y / c.heads]; });
  const int total = (int)work->order.size();
  auto worker = [work, total, &c, &item]() {
    for (int at; (at = work->next.fetch_add(1)) < total;) {
      const int id = work->order[at];
      item(id / c.heads, id % c.heads);
      if (work->done.fetch_add(1) + 1 == total) {
        std::lock_guard<std::mutex> lock(work->mu);
        work->all_done.notify_all();
      }
    }
  };
  const int threads = Workers(pool, total);
  for (int t = 1; t < threads; ++t) pool.Schedule(decltype(worker)(worker));
  worker();
  std::unique_lock<std::mutex> lock(work->mu);
  work->all_done.wait(lock, [&] { return work->done.load() == total; });
}

ffi::Error Check(const Call& c, int64_t q_elems, int64_t k_elems, int64_t v_elems, int64_t targets_elems,
                 int64_t bias_elems) {
  if (q_elems != (int64_t)c.num_tokens * c.heads * c.d || k_elems != q_elems ||
      v_elems != (int64_t)c.num_tokens * c.heads * c.dv)
    return ffi::Error::InvalidArgument("gem_hstu: q, k, v sizes disagree");
  if (c.s.has_bias && bias_elems != (int64_t)c.heads * c.s.n_max)
    return ffi::Error::InvalidArgument("gem_hstu: the bias must be H x max_seq_len");
  if (targets_elems != c.num_rows) return ffi::Error::InvalidArgument("gem_hstu: one target count per row");
  for (int b = 0; b < c.num_rows; ++b)
    if (c.offsets[b] < 0 || c.offsets[b + 1] < c.offsets[b] || c.offsets[b + 1] > c.num_tokens)
      return ffi::Error::InvalidArgument("gem_hstu: offsets must be non-decreasing within [0, T]");
  return ffi::Error::Success();
}

Call MakeCall(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& v, ffi::Buffer<ffi::S32>& offsets,
              int64_t max_seq_len, float alpha, int64_t causal, int64_t has_targets, int64_t max_attn_len,
              int64_t contextual, int64_t has_bias) {
  Call c{};
  c.s = Static{(int)max_seq_len, alpha, causal != 0, has_targets != 0, (int)max_attn_len, (int)contextual,
               has_bias != 0};
  auto qd = q.dimensions();
  c.num_tokens = (int)qd[0];
  c.heads = (int)qd[1];
  c.d = (int)qd[2];
  c.dv = (int)v.dimensions()[2];
  c.num_rows = (int)offsets.element_count() - 1;
  c.bias_stride = max_seq_len + kLanes;
  return c;
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                   ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> offsets, ffi::Buffer<ffi::S32> targets,
                   ffi::Buffer<ffi::F32> bias, ffi::ResultBuffer<ffi::F32> out, int64_t max_seq_len, float alpha,
                   int64_t causal, int64_t has_targets, int64_t max_attn_len, int64_t contextual,
                   int64_t has_bias) {
  Call c = MakeCall(q, v, offsets, max_seq_len, alpha, causal, has_targets, max_attn_len, contextual, has_bias);
  c.q = q.typed_data();
  c.k = k.typed_data();
  c.v = v.typed_data();
  c.offsets = offsets.typed_data();
  c.targets = targets.typed_data();
  c.bias = bias.typed_data();
  c.out = out->typed_data();
  if (ffi::Error e = Check(c, q.element_count(), k.element_count(), v.element_count(), targets.element_count(),
                             bias.element_count());
      e.failure())
    return e;
  std::fill(c.out, c.out + out->element_count(), 0.0f);
  Run(pool, c, [&c](int b, int h) { ForwardItem(c, b, h); });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                    ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> dout, ffi::Buffer<ffi::S32> offsets,
                    ffi::Buffer<ffi::S32> targets, ffi::Buffer<ffi::F32> bias, ffi::ResultBuffer<ffi::F32> dq,
                    ffi::ResultBuffer<ffi::F32> dk, ffi::ResultBuffer<ffi::F32> dv,
                    ffi::ResultBuffer<ffi::F32> dbias, int64_t max_seq_len, float alpha, int64_t causal,
                    int64_t has_targets, int64_t max_attn_len, int64_t contextual, int64_t has_bias) {
  Call c = MakeCall(q, v, offsets, max_seq_len, alpha, causal, has_targets, max_attn_len, contextual, has_bias);
  c.q = q.typed_data();
  c.k = k.typed_data();
  c.v = v.typed_data();
  c.dout = dout.typed_data();
  c.offsets = offsets.typed_data();
  c.targets = targets.typed_data();
  c.bias = bias.typed_data();
  c.dq = dq->typed_data();
  c.dk = dk->typed_data();
  c.dv_out = dv->typed_data();
  if (ffi::Error e = Check(c, q.element_count(), k.element_count(), v.element_count(), targets.element_count(),
                             bias.element_count());
      e.failure())
    return e;
  if (dout.element_count() != v.element_count())
    return ffi::Error::InvalidArgument("gem_hstu: dout and v sizes disagree");
  for (auto* buf : {c.dq, c.dk}) std::fill(buf, buf + q.element_count(), 0.0f);
  std::fill(c.dv_out, c.dv_out + v.element_count(), 0.0f);
  std::vector<float> items(c.s.has_bias ? (size_t)c.num_rows * c.heads * c.bias_stride : 0, 0.0f);
  c.dbias_items = items.data();
  Run(pool, c, [&c](int b, int h) { BackwardItem(c, b, h); });
  float* db = dbias->typed_data();
  std::fill(db, db + dbias->element_count(), 0.0f);
  if (c.s.has_bias) {
    for (int b = 0; b < c.num_rows; ++b)
      for (int h = 0; h < c.heads; ++h) {
        const float* from = items.data() + ((long)b * c.heads + h) * c.bias_stride;
        for (int d = 0; d < c.s.n_max; ++d) db[(long)h * c.s.n_max + d] += from[d];
      }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemHstuForward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("max_seq_len")
                                  .Attr<float>("alpha")
                                  .Attr<int64_t>("causal")
                                  .Attr<int64_t>("has_targets")
                                  .Attr<int64_t>("max_attn_len")
                                  .Attr<int64_t>("contextual_seq_len")
                                  .Attr<int64_t>("has_bias"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemHstuBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("max_seq_len")
                                  .Attr<float>("alpha")
                                  .Attr<int64_t>("causal")
                                  .Attr<int64_t>("has_targets")
                                  .Attr<int64_t>("max_attn_len")
                                  .Attr<int64_t>("contextual_seq_len")
                                  .Attr<int64_t>("has_bias"));

// Few-row float32 matmul for the embedded sampler's decode steps on x86-64 CPUs (AVX2 + FMA),
// registered as the XLA FFI target "rljax_panel_matmul" (rljax/models/panel_matmul.py builds, loads
// and calls it; docs/results.md has the measurements), and the decode steps' attention over a KV
// cache with transposed keys ("rljax_decode_attention", at the end).
//
//   y[M, N] = x[M, K] @ W[K, N],  W stored as column panels P[N / 16, K, 16]: P[p, k, j] = W[k, 16 p + j]
//
// A decode step multiplies a few rows (one per sequence) by every weight matrix, so the weights are
// read once per step and the rows are reused: each 16-column panel (K x 16 floats, contiguous) is
// streamed once per tile of rows while up to 6 rows accumulate in 12 AVX registers, and the next
// panel is prefetched while the current one is multiplied. Work items (row tile x chunk of panels)
// are shared with XLA's intra-op thread pool through an atomic counter; the calling thread takes
// items too, so the call completes even when no pool thread is free.
//
// A second target, "rljax_panel_matmul_avx512", multiplies the same panels with AVX-512: one panel
// row is one 16-float register, two panels stream side by side while up to 12 rows accumulate in
// 24 of the 32 registers (each broadcast input feeds two FMAs, so a k step does 2 + MR loads for
// 2 MR FMAs instead of the AVX2 kernel's 2 + 6 for 12). Its functions are compiled for AVX-512F
// alone (a target attribute), so the library still loads on CPUs without it; Python calls it only
// where rljax_panel_matmul_avx512_supported() says the CPU has it.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 16;        // columns per panel: two 8-float AVX registers
constexpr int64_t kRowTile = 48;      // rows whose inputs stay in L2 while every panel streams by
constexpr int64_t kPanelsPerItem = 4; // panels per work item
constexpr int64_t kMinParallelMacs = int64_t{1} << 20;  // smaller products run on the calling thread:
                                                        // scheduling a helper costs more than it saves

// One row's step: (c0, c1) += x_k * (w0, w1).
inline void Accumulate(const float* x_k, __m256 w0, __m256 w1, __m256& c0, __m256& c1) {
  const __m256 b = _mm256_broadcast_ss(x_k);
  c0 = _mm256_fmadd_ps(b, w0, c0);
  c1 = _mm256_fmadd_ps(b, w1, c1);
}

inline void Store(float* y, __m256 c0, __m256 c1) {
  _mm256_storeu_ps(y, c0);
  _mm256_storeu_ps(y + 8, c1);
}

// y[0:MR, 0:16] = x[0:MR, :] @ panel[K, 16]; rows of x are K apart, rows of y ldy apart.
// Named accumulators (not an array: GCC kept an array of them on the stack) keep all 2 * MR of
// them in registers; the helpers above are inlined onto them.
template <int MR>
inline void MicroKernel(const float* x, int64_t K, const float* panel, float* y, int64_t ldy,
                        const float* prefetch) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t k = 0; k < K; ++k) {
    if (prefetch != nullptr) _mm_prefetch(reinterpret_cast<const char*>(prefetch + kPanel * k), _MM_HINT_T1);
    const __m256 w0 = _mm256_loadu_ps(panel + kPanel * k);
    const __m256 w1 = _mm256_loadu_ps(panel + kPanel * k + 8);
    Accumulate(x + k, w0, w1, c00, c01);
    if constexpr (MR > 1) Accumulate(x + K + k, w0, w1, c10, c11);
    if constexpr (MR > 2) Accumulate(x + 2 * K + k, w0, w1, c20, c21);
    if constexpr (MR > 3) Accumulate(x + 3 * K + k, w0, w1, c30, c31);
    if constexpr (MR > 4) Accumulate(x + 4 * K + k, w0, w1, c40, c41);
    if constexpr (MR > 5) Accumulate(x + 5 * K + k, w0, w1, c50, c51);
  }
  Store(y, c00, c01);
  if constexpr (MR > 1) Store(y + ldy, c10, c11);
  if constexpr (MR > 2) Store(y + 2 * ldy, c20, c21);
  if constexpr (MR > 3) Store(y + 3 * ldy, c30, c31);
  if constexpr (MR > 4) Store(y + 4 * ldy, c40, c41);
  if constexpr (MR > 5) Store(y + 5 * ldy, c50, c51);
}

// Rows [r0, r1) against panels [p0, p1).
void Block(const float* x, const float* panels, float* y, int64_t K, int64_t N, int64_t num_panels, int64_t r0,
           int64_t r1, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const float* panel = panels + p * K * kPanel;
    const float* next = p + 1 < num_panels ? panel + K * kPanel : nullptr;
    float* yp = y + p * kPanel;
    int64_t r = r0;
    for (; r + 6 <= r1; r += 6) {
      MicroKernel<6>(x + r * K, K, panel, yp + r * N, N, r == r0 ? next : nullptr);
    }
    const float* pf = r == r0 ? next : nullptr;
    switch (r1 - r) {
      case 5: MicroKernel<5>(x + r * K, K, panel, yp + r * N, N, pf); break;
      case 4: MicroKernel<4>(x + r * K, K, panel, yp + r * N, N, pf); break;
      case 3: MicroKernel<3>(x + r * K, K, panel, yp + r * N, N, pf); break;
      case 2: MicroKernel<2>(x + r * K, K, panel, yp + r * N, N, pf); break;
      case 1: MicroKernel<1>(x + r * K, K, panel, yp + r * N, N, pf); break;
      default: break;
    }
  }
}

// -- AVX-512 ------------------------------------------------------------------------------------

#define RLJAX_AVX512 __attribute__((target("avx512f")))

constexpr int kMaxRows512 = 12;  // rows per micro-kernel call: 2 x 12 accumulators + 2 panel rows

// y[0:MR, 0:16 NP] = x[0:MR, :] @ [panel0 | panel1][K, 16 NP]. The accumulators are a fixed-size
// array indexed only by compile-time constants (fully unrolled), which GCC keeps in registers.
template <int MR, int NP>
RLJAX_AVX512 void MicroKernel512(const float* x, int64_t K, const float* panel0, const float* panel1, float* y,
                                 int64_t ldy, const float* prefetch0, const float* prefetch1) {
  __m512 c[MR][NP];
#pragma GCC unroll 24
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j) c[r][j] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    if (prefetch0 != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(prefetch0 + kPanel * k), _MM_HINT_T1);
      if (NP > 1) _mm_prefetch(reinterpret_cast<const char*>(prefetch1 + kPanel * k), _MM_HINT_T1);
    }
    const __m512 w0 = _mm512_loadu_ps(panel0 + kPanel * k);
    const __m512 w1 = NP > 1 ? _mm512_loadu_ps(panel1 + kPanel * k) : w0;
#pragma GCC unroll 24
    for (int r = 0; r < MR; ++r) {
      const __m512 b = _mm512_set1_ps(x[r * K + k]);
      c[r][0] = _mm512_fmadd_ps(b, w0, c[r][0]);
      if constexpr (NP > 1) c[r][NP - 1] = _mm512_fmadd_ps(b, w1, c[r][NP - 1]);
    }
  }
#pragma GCC unroll 24
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(y + r * ldy, c[r][0]);
    if constexpr (NP > 1) _mm512_storeu_ps(y + r * ldy + kPanel, c[r][NP - 1]);
  }
}

using MicroKernel512Fn = void (*)(const float*, int64_t, const float*, const float*, float*, int64_t,
                                  const float*, const float*);

template <int NP, std::size_t... I>
constexpr std::array<MicroKernel512Fn, sizeof...(I)> MicroKernels512(std::index_sequence<I...>) {
  return {&MicroKernel512<static_cast<int>(I) + 1, NP>...};
}

// kKernels512[NP - 1][MR - 1]: the micro-kernel of MR rows and NP panels.
const std::array<MicroKernel512Fn, kMaxRows512> kKernels512[2] = {
    MicroKernels512<1>(std::make_index_sequence<kMaxRows512>{}),
    MicroKernels512<2>(std::make_index_sequence<kMaxRows512>{}),
};

// Rows [r0, r1) against panels [p0, p1), two panels at a time; the rows are cut into the fewest
// calls of at most kMaxRows512, of balanced sizes (32 rows: 11 + 11 + 10).
void Block512(const float* x, const float* panels, float* y, int64_t K, int64_t N, int64_t num_panels, int64_t r0,
              int64_t r1, int64_t p0, int64_t p1) {
  const int64_t rows = r1 - r0;
  const int64_t calls = (rows + kMaxRows512 - 1) / kMaxRows512;
  for (int64_t p = p0; p < p1; p += 2) {
    const int64_t np = std::min<int64_t>(2, p1 - p);
    const float* panel = panels + p * K * kPanel;
    const float* next = p + np < num_panels ? panel + np * K * kPanel : nullptr;
    const float* next1 = next != nullptr && p + np + 1 < num_panels ? next + K * kPanel : nullptr;
    int64_t r = r0;
    for (int64_t call = 0; call < calls; ++call) {
      const int64_t mr = rows / calls + (call < rows % calls ? 1 : 0);
      const bool first = call == 0;
      kKernels512[np - 1][mr - 1](x + r * K, K, panel, panel + K * kPanel, y + r * N + p * kPanel, N,
                                  first ? next : nullptr, first && next1 != nullptr ? next1 : next);
      r += mr;
    }
  }
}

// -- the FFI handlers -----------------------------------------------------------------------------

using BlockFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                         int64_t, int64_t);

struct Work {
  BlockFn block;
  const float* x;
  const float* panels;
  float* y;
  int64_t M, K, N, num_panels, chunks, items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Run() {
    for (;;) {
      const int64_t item = next.fetch_add(1, std::memory_order_relaxed);
      if (item >= items) return;
      const int64_t tile = item / chunks, chunk = item % chunks;
      const int64_t r0 = tile * kRowTile, p0 = chunk * kPanelsPerItem;
      block(x, panels, y, K, N, num_panels, r0, std::min(M, r0 + kRowTile), p0,
            std::min(num_panels, p0 + kPanelsPerItem));
      done.fetch_add(1, std::memory_order_acq_rel);
    }
  }
};

ffi::Error Run(BlockFn block, ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
               ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto pd = panels.dimensions();
  if (xd.size() != 2 || pd.size() != 3 || pd[2] != kPanel || pd[1] != xd[1]) {
    return ffi::Error::InvalidArgument("rljax_panel_matmul: expected x [M, K] and panels [N/16, K, 16]");
  }
  auto work = std::make_shared<Work>();
  work->block = block;
  work->x = x.typed_data();
  work->panels = panels.typed_data();
  work->y = y->typed_data();
  work->M = xd[0];
  work->K = xd[1];
  work->num_panels = pd[0];
  work->N = pd[0] * kPanel;
  work->chunks = (work->num_panels + kPanelsPerItem - 1) / kPanelsPerItem;
  work->items = work->chunks * ((work->M + kRowTile - 1) / kRowTile);
  if (work->items == 0) return ffi::Error::Success();
  const int64_t macs = work->M * work->K * work->N;
  const int64_t helpers = macs < kMinParallelMacs ? 0 : std::min<int64_t>(pool.num_threads(), work->items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Run(); });
  work->Run();
  // Every item is claimed; wait for those a helper is still multiplying.
  while (work->done.load(std::memory_order_acquire) < work->items) _mm_pause();
  return ffi::Error::Success();
}

ffi::Error PanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
                       ffi::ResultBuffer<ffi::F32> y) {
  return Run(&Block, pool, x, panels, y);
}

ffi::Error PanelMatmul512(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
                          ffi::ResultBuffer<ffi::F32> y) {
  return Run(&Block512, pool, x, panels, y);
}

// -- decode attention ----------------------------------------------------------------------------
//
// One decode step's attention for every (row, kv head) entry c = b * K + k of the KV cache, keys
// stored transposed (rljax.models.attention.cache_attention with transposed_keys):
//
//   s[g, j] = scale * q[c, g, :] . keys[c, :, j]   where valid[b, j], else kMaskValue
//   out[c, g, :] = sum_j softmax_j(s[g, :]) values[c, j, :]
//
// q [C, G, D], keys [C, D, S], values [C, S, D], valid [B, S] (int32, C = B * K), out [C, G, D];
// D a multiple of 8. XLA:CPU runs this attention on one thread at ~10 GB/s; here the entries are
// shared with the intra-op pool like the matmul's work items, and each entry streams its keys once
// (row by row over the head dim, up to 2 queries' scores for a tile of slots kept in L1) and its
// values once (64 head dims x up to 2 queries accumulating in registers per slot), prefetching ahead.

constexpr float kMaskValue = -0.7f * 3.4028234663852886e38f;  // rljax.models.attention's _MASK_VALUE
constexpr int64_t kMinParallelBytes = int64_t{1} << 20;          // smaller caches: the calling thread
constexpr int64_t kPrefetchFloats = 256;  // software prefetch distance in the streamed keys / values (1 KiB)
constexpr int64_t kSlotTile = 1024;  // slots whose scores (up to 2 queries: 8 KiB) stay in L1 per key row

// exp(x) for x <= 0 (softmax arguments), float32 within ~2 ulp: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2.
inline __m256 Exp(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // Cody-Waite: ln2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);  // Cephes expf's minimax polynomial
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

struct AttentionWork {
  const float* q;
  const float* keys;
  const float* values;
  const int32_t* valid;
  float* out;
  float scale;
  int64_t C, K, G, D, S;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // Dot products of entry c's queries [g0, g0 + NG) with its keys, into s[NG][S]. The key rows stream in
  // order (each row of a tile of slots is contiguous); the tile's scores stay in L1 meanwhile.
  template <int NG>
  void Scores(int64_t c, int64_t g0, float* s) const {
    const float* kc = keys + c * D * S;
    const float* qc = q + (c * G + g0) * D;
    const int32_t* ok = valid + (c / K) * S;
    const int64_t full = S - S % 8;
    for (int64_t t0 = 0; t0 < S; t0 += kSlotTile) {
      const int64_t t1 = std::min(S, t0 + kSlotTile), v1 = std::min(full, t1);
      for (int g = 0; g < NG; ++g) std::fill(s + g * S + t0, s + g * S + t1, 0.0f);
      for (int64_t d = 0; d < D; ++d) {
        const float* row = kc + d * S;
        __m256 qd[NG];
        for (int g = 0; g < NG; ++g) qd[g] = _mm256_broadcast_ss(qc + g * D + d);
        int64_t j = t0;
        for (; j < v1; j += 8) {
          _mm_prefetch(reinterpret_cast<const char*>(row + j + kPrefetchFloats), _MM_HINT_T0);
          const __m256 k = _mm256_loadu_ps(row + j);
          for (int g = 0; g < NG; ++g) {
            float* sg = s + g * S + j;
            _mm256_storeu_ps(sg, _mm256_fmadd_ps(qd[g], k, _mm256_loadu_ps(sg)));
          }
        }
        for (; j < t1; ++j)
          for (int g = 0; g < NG; ++g) s[g * S + j] += qc[g * D + d] * row[j];
      }
    }
  }

  // s[g, :] (raw dot products) -> exp(scale * s - max) in place, 0 where masked; returns the sum.
  float Softmax(float* s, const int32_t* ok) const {
    const int64_t full = S - S % 8;
    const __m256 sc = _mm256_set1_ps(scale), masked = _mm256_set1_ps(kMaskValue);
    __m256 mv = masked;
    for (int64_t j = 0; j < full; j += 8) {
      const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ok + j)), _mm256_setzero_si256()));
      const __m256 x = _mm256_blendv_ps(masked, _mm256_mul_ps(_mm256_loadu_ps(s + j), sc), keep);
      _mm256_storeu_ps(s + j, x);
      mv = _mm256_max_ps(mv, x);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mv);
    float m = kMaskValue;
    for (float x : lanes) m = std::max(m, x);
    for (int64_t j = full; j < S; ++j) {
      s[j] = ok[j] > 0 ? s[j] * scale : kMaskValue;
      m = std::max(m, s[j]);
    }
    if (m == kMaskValue) {  // no slot to attend to: the reference's uniform average over all of them
      std::fill(s, s + S, 1.0f);
      return static_cast<float>(S);
    }
    const __m256 mx = _mm256_set1_ps(m);
    __m256 total = _mm256_setzero_ps();
    for (int64_t j = 0; j < full; j += 8) {
      const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ok + j)), _mm256_setzero_si256()));
      const __m256 e = _mm256_and_ps(keep, Exp(_mm256_sub_ps(_mm256_loadu_ps(s + j), mx)));
      _mm256_storeu_ps(s + j, e);
      total = _mm256_add_ps(total, e);
    }
    _mm256_store_ps(lanes, total);
    float sum = 0.0f;
    for (float x : lanes) sum += x;
    for (int64_t j = full; j < S; ++j) {
      alignas(32) float one[8] = {s[j] - m};
      _mm256_store_ps(one, Exp(_mm256_load_ps(one)));
      s[j] = ok[j] > 0 ? one[0] : 0.0f;
      sum += s[j];
    }
    return sum;
  }

  // out[c, g0 + g, :] = sum_j p[g, j] values[c, j, :] / total[g], for NG <= 2 queries.
  template <int NG>
  void Weighted(int64_t c, int64_t g0, const float* p, const float* total) const {
    const float* vc = values + c * S * D;
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      const int width = static_cast<int>(std::min<int64_t>(64, D - d0)) / 8;
      __m256 a[NG][8];
      for (int g = 0; g < NG; ++g)
        for (int i = 0; i < 8; ++i) a[g][i] = _mm256_setzero_ps();
      for (int64_t j = 0; j < S; ++j) {
        const float* vr = vc + j * D + d0;
        _mm_prefetch(reinterpret_cast<const char*>(vr + kPrefetchFloats), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(vr + kPrefetchFloats + 16), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(vr + kPrefetchFloats + 32), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(vr + kPrefetchFloats + 48), _MM_HINT_T0);
        __m256 pj[NG];
        for (int g = 0; g < NG; ++g) pj[g] = _mm256_broadcast_ss(p + g * S + j);
        for (int i = 0; i < width; ++i) {
          const __m256 v = _mm256_loadu_ps(vr + 8 * i);
          for (int g = 0; g < NG; ++g) a[g][i] = _mm256_fmadd_ps(pj[g], v, a[g][i]);
        }
      }
      for (int g = 0; g < NG; ++g) {
        const __m256 inv = _mm256_set1_ps(1.0f / total[g]);
        float* o = out + (c * G + g0 + g) * D + d0;
        for (int i = 0; i < width; ++i) _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(a[g][i], inv));
      }
    }
  }

  void Entry(int64_t c, float* s) const {
    const int32_t* ok = valid + (c / K) * S;
    for (int64_t g0 = 0; g0 < G;) {
      const int64_t ng = std::min<int64_t>(G - g0, 2);
      if (ng == 2) Scores<2>(c, g0, s); else Scores<1>(c, g0, s);
      float total[2];
      for (int64_t g = 0; g < ng; ++g) total[g] = Softmax(s + g * S, ok);
      if (ng == 2) Weighted<2>(c, g0, s, total); else Weighted<1>(c, g0, s, total);
      g0 += ng;
    }
  }

  void Run() {
    std::unique_ptr<float[]> s(new float[2 * S]);
    for (;;) {
      const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= C) return;
      Entry(c, s.get());
      done.fetch_add(1, std::memory_order_acq_rel);
    }
  }
};

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> keys,
                           ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::S32> valid, ffi::ResultBuffer<ffi::F32> out,
                           float scale) {
  const auto qd = q.dimensions(), kd = keys.dimensions(), vd = values.dimensions(), md = valid.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || vd.size() != 3 || md.size() != 2 || kd[0] != qd[0] || vd[0] != qd[0] ||
      kd[1] != qd[2] || vd[2] != qd[2] || vd[1] != kd[2] || md[1] != kd[2] || md[0] == 0 || qd[0] % md[0] != 0 ||
      qd[2] % 8 != 0) {
    return ffi::Error::InvalidArgument(
        "rljax_decode_attention: expected q [C, G, D], keys [C, D, S], values [C, S, D], valid [B, S] with "
        "C a multiple of B and D of 8");
  }
  auto work = std::make_shared<AttentionWork>();
  work->q = q.typed_data();
  work->keys = keys.typed_data();
  work->values = values.typed_data();
  work->valid = valid.typed_data();
  work->out = out->typed_data();
  work->scale = scale;
  work->C = qd[0];
  work->K = qd[0] / md[0];
  work->G = qd[1];
  work->D = qd[2];
  work->S = kd[2];
  if (work->C == 0 || work->G == 0) return ffi::Error::Success();
  const int64_t bytes = 8 * work->C * work->D * work->S;
  const int64_t helpers = bytes < kMinParallelBytes ? 0 : std::min<int64_t>(pool.num_threads(), work->C) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load(std::memory_order_acquire) < work->C) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RljaxPanelMatmul, PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RljaxPanelMatmulAvx512, PanelMatmul512,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RljaxDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

// 1 when this CPU runs AVX2 and FMA instructions (the kernel's), else 0.
extern "C" int rljax_panel_matmul_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
}

// 1 when this CPU runs AVX-512F instructions (the "rljax_panel_matmul_avx512" kernel's), else 0.
extern "C" int rljax_panel_matmul_avx512_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") ? 1 : 0;
}

// Few-row float32 matmul for the embedded sampler's decode steps on x86-64 CPUs (AVX2 + FMA),
// registered as the XLA FFI target "rljax_panel_matmul" (rljax/models/panel_matmul.py builds, loads
// and calls it; the README's generation section has the measurements).
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

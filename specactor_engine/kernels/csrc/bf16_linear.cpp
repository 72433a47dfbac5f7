// A bf16 linear layer for CPUs with AVX-512 BF16 and no AMX: y = x @ W.T (+ b), fp32 accumulation.
//
// oneDNN's bf16 GEMM on the AMD EPYC (Zen 4, avx512_bf16) streamed a Qwen2.5-1.5B decode step's weights at
// ~33 GB/s at 4 rows (its small-M kernels) and reached ~265-330 GFLOP/s on weights streamed from memory at
// 12-16 rows. This kernel is the plain form of the same arithmetic: the weight is packed once so that every
// 64-byte load holds 16 output columns x one pair of the reduction (the layout VDPBF16PS reads), and each
// thread walks its own contiguous range of 32-column groups from the first K pair to the last, so the
// hardware prefetcher sees one stream per thread. Measured inside the model (Qwen2.5-1.5B bf16, 4 rows,
// bench/session39/linear_timing.py): a decode step 1.18-1.57x and a 16-token verify 1.21-1.25x oneDNN's (a step
// gains what the machine's memory state allows; verifies are compute-bound).
//
// A verify's 8-24 rows need the weights at the rate the arithmetic eats them (12 rows: 128 bytes per 12 cycles a
// core), and the hardware prefetcher alone fell behind once the cores were busy: 12 rows ran at ~510 GFLOP/s from
// memory against ~850 on weights in L2. So each K pair also prefetches the weight 8 KB ahead (into the next group
// at a group's end: a thread's groups are contiguous), and up to 12 rows share one pass over a group (24
// accumulators), which streams the weight from memory once instead of twice for 9-12 rows. Qwen2.5-1.5B's
// decoder linears, 28 layers streamed from memory, alternated in one process (bench/session42/linear_prefetch.py):
// 4 rows 1.00-1.10x, 8 rows 1.31-1.41x, 12 rows 1.31-1.69x, 16-24 rows 1.18-1.39x, 32-128 rows 1.05-1.17x faster;
// 12 rows now take about what 4 rows take.
//
//   packed = bf16_linear_pack(W)         W [N, K] bf16, K even -> [G, K/2, 2, 32] bf16, G = ceil(N / 32)
//                                        packed[g][p][b][2j + t] = W[32g + 16b + j][2p + t] (0 past N)
//   y = bf16_linear(x, packed, b, N, v)  x [M, K] bf16, b [N] bf16 or None -> y [M, N] bf16; v: the variant below
//
// Every output is one fp32 accumulator that runs through the K pairs in order, one VDPBF16PS each
// (acc += x[2p+1] w[2p+1] + x[2p] w[2p]), plus the bias in fp32, rounded to bf16 once (nearest even). No
// step depends on M or on the other rows: a row's result is the same bits alone or among any rows, which is
// what keeps a verify block and a decode step identical (oneDNN changes kernels with the row count).
//
// Two ways to run that arithmetic (`variant`): 0, VDPBF16PS; 1, two fp32 FMAs per pair on the weight widened
// in registers (a bf16 is the high half of an fp32: AND or shift left by 16). A product of two bf16 values is
// exact in fp32, so FMA(x[2p+1], w[2p+1], acc) then FMA(x[2p], w[2p], acc) rounds exactly where VDPBF16PS does;
// VDPBF16PS also treats denormal inputs as zero and flushes denormal results (DAZ and FTZ whatever MXCSR says),
// which the FMA variant sets in MXCSR for its threads while it runs. So both give the same bits, and which runs
// is a matter of speed: on the AMD EPYC (Zen 4) VDPBF16PS (64 flops an instruction against an FMA's 32) reached
// ~850-900 GFLOP/s on 2 cores (session 42; the FMAs were not timed there), but on the Intel
// Xeon of sessions 54-59 (AVX-512 BF16, no AMX) one VDPBF16PS issues every 2 cycles a core against 2 FMAs a
// cycle (bench/session59/peak.c: 85 against 172 GFLOP/s a core), and the FMA variant ran 12 rows at 258-262
// GFLOP/s on 2 cores against 159-168 (bench/session59/tile.cpp). `kernels/bf16_linear.py` times both once per
// process and uses the faster.
#include <torch/library.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "huge_pages.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t GROUP = 32;     // output columns per group: two zmm of 16 fp32 accumulators
constexpr int ROWS_PER_TILE = 12;  // rows sharing a group's weight loads: up to 24 accumulators of the 32 registers
constexpr int64_t PREFETCH_AHEAD = 128;  // 64-byte weight lines (64 K pairs) ahead of the one loaded

at::Tensor bf16_linear_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
              "bf16_linear_pack: expected a 2-D bfloat16 CPU weight, got ", weight.sizes(), " ", weight.scalar_type());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 2 == 0, "bf16_linear_pack: the input width must be even, got ", K);
  const int64_t G = (N + GROUP - 1) / GROUP, P = K / 2;
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = specactor::empty_on_huge_pages({G, P, 2, GROUP}, weight.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < 2; ++b)
        for (int64_t j = 0; j < 16; ++j) {
          const int64_t n = g * GROUP + b * 16 + j;
          for (int64_t p = 0; p < P; ++p) {  // zero columns past N
            uint16_t* out = dst + ((g * P + p) * 2 + b) * GROUP + 2 * j;
            out[0] = n < N ? src[n * K + 2 * p] : 0;
            out[1] = n < N ? src[n * K + 2 * p + 1] : 0;
          }
        }
  });
  return packed;
}

#if defined(__AVX512BF16__)

// rows x 32 columns of one group over every K pair; acc [rows][32] fp32.
template <int ROWS>
inline void tile(const int32_t* x, int64_t P, const __m512bh* w, float* acc) {
  __m512 lo[ROWS], hi[ROWS];
  for (int m = 0; m < ROWS; ++m) {
    lo[m] = _mm512_setzero_ps();
    hi[m] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < P; ++p) {
    _mm_prefetch(reinterpret_cast<const char*>(w + 2 * p + PREFETCH_AHEAD), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + 2 * p + 1 + PREFETCH_AHEAD), _MM_HINT_T0);
    const __m512bh w0 = w[2 * p], w1 = w[2 * p + 1];
    for (int m = 0; m < ROWS; ++m) {
      const __m512bh pair = (__m512bh)_mm512_set1_epi32(x[m * P + p]);  // (x[2p], x[2p+1]) in every lane
      lo[m] = _mm512_dpbf16_ps(lo[m], pair, w0);
      hi[m] = _mm512_dpbf16_ps(hi[m], pair, w1);
    }
  }
  for (int m = 0; m < ROWS; ++m) {
    _mm512_storeu_ps(acc + m * GROUP, lo[m]);
    _mm512_storeu_ps(acc + m * GROUP + 16, hi[m]);
  }
}

using TileFn = void (*)(const int32_t*, int64_t, const __m512bh*, float*);
constexpr TileFn TILES[ROWS_PER_TILE + 1] = {nullptr, tile<1>, tile<2>,  tile<3>,  tile<4>,  tile<5>, tile<6>,
                                             tile<7>, tile<8>, tile<9>, tile<10>, tile<11>, tile<12>};

// The same tile with fp32 FMAs. xf [ROWS][P][2] fp32 holds each pair as (x[2p+1], x[2p]); a weight line's
// 32-bit lane j holds (w[2p] low, w[2p+1] high) of column j: the high half masked is w[2p+1] as an fp32, the
// lane shifted left by 16 is w[2p].
template <int ROWS>
inline void tile_fma(const float* xf, int64_t P, const __m512i* w, float* acc) {
  __m512 lo[ROWS], hi[ROWS];
  for (int m = 0; m < ROWS; ++m) {
    lo[m] = _mm512_setzero_ps();
    hi[m] = _mm512_setzero_ps();
  }
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t p = 0; p < P; ++p) {
    _mm_prefetch(reinterpret_cast<const char*>(w + 2 * p + PREFETCH_AHEAD), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + 2 * p + 1 + PREFETCH_AHEAD), _MM_HINT_T0);
    const __m512i w0 = _mm512_load_si512(w + 2 * p), w1 = _mm512_load_si512(w + 2 * p + 1);
    const __m512 w0_odd = _mm512_castsi512_ps(_mm512_and_si512(w0, high));
    const __m512 w0_even = _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16));
    const __m512 w1_odd = _mm512_castsi512_ps(_mm512_and_si512(w1, high));
    const __m512 w1_even = _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16));
    for (int m = 0; m < ROWS; ++m) {
      const __m512 x_odd = _mm512_set1_ps(xf[(m * P + p) * 2]), x_even = _mm512_set1_ps(xf[(m * P + p) * 2 + 1]);
      lo[m] = _mm512_fmadd_ps(x_odd, w0_odd, lo[m]);
      hi[m] = _mm512_fmadd_ps(x_odd, w1_odd, hi[m]);
      lo[m] = _mm512_fmadd_ps(x_even, w0_even, lo[m]);
      hi[m] = _mm512_fmadd_ps(x_even, w1_even, hi[m]);
    }
  }
  for (int m = 0; m < ROWS; ++m) {
    _mm512_storeu_ps(acc + m * GROUP, lo[m]);
    _mm512_storeu_ps(acc + m * GROUP + 16, hi[m]);
  }
}

using FmaTileFn = void (*)(const float*, int64_t, const __m512i*, float*);
constexpr FmaTileFn FMA_TILES[ROWS_PER_TILE + 1] = {
    nullptr,        tile_fma<1>, tile_fma<2>, tile_fma<3>,  tile_fma<4>,  tile_fma<5>, tile_fma<6>,
    tile_fma<7>,    tile_fma<8>, tile_fma<9>, tile_fma<10>, tile_fma<11>, tile_fma<12>};

// MXCSR's flush-to-zero and denormals-are-zero bits, set for a scope (VDPBF16PS's handling of denormals)
class DenormalsAsZero {
 public:
  DenormalsAsZero() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
  ~DenormalsAsZero() { _mm_setcsr(saved_); }
  DenormalsAsZero(const DenormalsAsZero&) = delete;
  DenormalsAsZero& operator=(const DenormalsAsZero&) = delete;

 private:
  unsigned saved_;
};

#endif

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t out_features, int64_t variant) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
                  packed.scalar_type() == at::kBFloat16 && packed.size(2) == 2 && packed.size(3) == GROUP,
              "bf16_linear: expected x [M, K] and a weight from bf16_linear_pack, both bfloat16");
  const int64_t M = x.size(0), K = x.size(1), G = packed.size(0), P = packed.size(1), N = out_features;
  TORCH_CHECK(2 * P == K && N > 0 && N <= G * GROUP, "bf16_linear: x has ", K, " columns and the packed weight ",
              2 * P, " (", N, " outputs of at most ", G * GROUP, ")");
  const at::Tensor b = bias.has_value() && bias->defined() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  TORCH_CHECK(!b.defined() || b.numel() == N, "bf16_linear: the bias has ", b.defined() ? b.numel() : 0,
              " values for ", N, " outputs");
  TORCH_CHECK(variant == 0 || variant == 1, "bf16_linear: variant must be 0 (VDPBF16PS) or 1 (fp32 FMA), got ",
              variant);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
#if defined(__AVX512BF16__)
  const at::Tensor xc = x.contiguous();
  const int32_t* x32 = reinterpret_cast<const int32_t*>(xc.data_ptr());
  const __m512bh* w = reinterpret_cast<const __m512bh*>(packed.data_ptr());
  const float* bias_f = b.defined() ? b.data_ptr<float>() : nullptr;
  uint16_t* y = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t tiles = (M + ROWS_PER_TILE - 1) / ROWS_PER_TILE;
  std::vector<float> xf;  // the FMA variant's x: each pair as (x[2p+1], x[2p]) in fp32, [M][P][2]
  if (variant == 1) {
    xf.resize(M * P * 2);
    const uint16_t* x16 = reinterpret_cast<const uint16_t*>(xc.data_ptr());
    for (int64_t i = 0; i < M * P; ++i) {
      const uint32_t odd = static_cast<uint32_t>(x16[2 * i + 1]) << 16, even = static_cast<uint32_t>(x16[2 * i]) << 16;
      std::memcpy(&xf[2 * i], &odd, sizeof(float));
      std::memcpy(&xf[2 * i + 1], &even, sizeof(float));
    }
  }
  // one contiguous range of groups per thread: each streams its part of the weight once
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> acc(M * GROUP);
    for (int64_t g = g0; g < g1; ++g) {
      const __m512bh* wg = w + g * P * 2;
      if (variant == 1) {
        const DenormalsAsZero daz;
        for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
          const int64_t rows = (M - m0) / (tiles - t);
          FMA_TILES[rows](xf.data() + m0 * P * 2, P, reinterpret_cast<const __m512i*>(wg), acc.data() + m0 * GROUP);
          m0 += rows;
        }
      } else {
        for (int64_t t = 0, m0 = 0; t < tiles; ++t) {  // rows split evenly into tiles of at most 12
          const int64_t rows = (M - m0) / (tiles - t);
          TILES[rows](x32 + m0 * P, P, wg, acc.data() + m0 * GROUP);
          m0 += rows;
        }
      }
      const int64_t n0 = g * GROUP, width = std::min<int64_t>(GROUP, N - n0);
      for (int64_t m = 0; m < M; ++m) {
        __m512 lo = _mm512_loadu_ps(acc.data() + m * GROUP), hi = _mm512_loadu_ps(acc.data() + m * GROUP + 16);
        if (bias_f != nullptr) {
          float padded[GROUP] = {};
          std::memcpy(padded, bias_f + n0, width * sizeof(float));
          lo = _mm512_add_ps(lo, _mm512_loadu_ps(padded));
          hi = _mm512_add_ps(hi, _mm512_loadu_ps(padded + 16));
        }
        uint16_t rounded[GROUP];
        const __m256bh lo16 = _mm512_cvtneps_pbh(lo), hi16 = _mm512_cvtneps_pbh(hi);
        std::memcpy(rounded, &lo16, 32);
        std::memcpy(rounded + 16, &hi16, 32);
        std::memcpy(y + m * N + n0, rounded, width * sizeof(uint16_t));
      }
    }
  });
#else
  TORCH_CHECK(false, "bf16_linear: this build has no AVX-512 BF16 (use oneDNN's linear)");
#endif
  return out;
}

bool bf16_linear_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specactor, m) {
  m.def("bf16_linear_pack(Tensor weight) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, Tensor? bias, int out_features, int variant=0) -> Tensor");
  m.def("bf16_linear_supported() -> bool", &bf16_linear_supported);
}

TORCH_LIBRARY_IMPL(specactor, CPU, m) {
  m.impl("bf16_linear_pack", &bf16_linear_pack);
  m.impl("bf16_linear", &bf16_linear);
}

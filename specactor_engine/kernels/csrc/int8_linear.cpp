// An int8 linear layer for drafting on CPUs with AVX-512 VNNI: y = (x quantized per row) @ (W int8 per column).T.
//
// A draft model's step at a few rows streams every weight once, so it costs its weights' bytes. PyTorch's dynamic
// int8 linear (fbgemm) streamed Qwen2.5-Coder-0.5B's 388 MB of int8 weights at ~38 GB/s in a 4-row step (10.3 of
// the step's 17 ms) where the machine's memory gives ~60. This kernel is the bf16 kernel's plan (bf16_linear.cpp)
// on bytes: the weight is packed once so that every 64-byte load holds 16 output columns x 4 consecutive inputs (the
// layout VPDPBUSD reads), each thread walks its own contiguous range of 32-column groups from the first input to
// the last, and rows share a group's loads in tiles of up to 8. Each input quad also prefetches the weight 8 KB
// ahead, as the bf16 kernel does (0.5B-shaped linears from memory, bench/session42/int8_prefetch.txt: 4 rows
// 1.03-1.08x, 8 rows 1.12-1.29x).
//
//   packed = int8_linear_pack(Wq)       Wq [N, K] int8 -> [G, Q, 32, 4] int8, G = ceil(N / 32), Q = ceil(K / 4)
//                                       packed[g][q][c][t] = Wq[32g + c][4q + t] (0 past N and past K)
//   y = int8_linear(x, packed, scale, colsum, b, N)
//       x [M, K] float32; scale [N] float32 (W ~ Wq * scale per column); colsum [N] int32 (sum_k Wq[n, k]);
//       b [N] float32 or None -> y [M, N] float32
//
// Activations are quantized per row, symmetrically: s_m = max_k |x[m, k]| / 127, xq = round_half_even(x * (127 /
// max)) in [-127, 127] (a row of zeros has s_m = 0). VPDPBUSD multiplies unsigned by signed bytes, so the kernel
// feeds xq + 128 and takes 128 x colsum back out: acc[m, n] = sum_k (xq + 128) Wq - 128 colsum[n] = sum_k xq Wq,
// exact in int32 (|acc| < 4 * 255 * 127 * Q). Then y = float(acc) * (s_m * scale[n]) + b[n] in float32. Every step
// depends on the row alone: a row's result is the same bits whatever other rows are in the call.
#include <torch/library.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "huge_pages.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define SPECACTOR_INT8_KERNEL 1
#endif

namespace {

constexpr int64_t GROUP = 32;     // output columns per group: two zmm of 16 int32 accumulators
constexpr int64_t QUAD = 4;       // inputs per VPDPBUSD lane
constexpr int ROWS_PER_TILE = 8;  // rows sharing a group's weight loads
constexpr int64_t ROW_BLOCK = 64; // rows whose quantized inputs stay in cache while a thread walks its groups
constexpr int64_t PREFETCH_AHEAD = 128;  // 64-byte weight lines (64 input quads) ahead of the one loaded

at::Tensor int8_linear_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.device().is_cpu(),
              "int8_linear_pack: expected a 2-D int8 CPU weight, got ", weight.sizes(), " ", weight.scalar_type());
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t G = (N + GROUP - 1) / GROUP, Q = (K + QUAD - 1) / QUAD;
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = specactor::empty_on_huge_pages({G, Q, GROUP, QUAD}, weight.options());
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t q = 0; q < Q; ++q)
        for (int64_t c = 0; c < GROUP; ++c)
          for (int64_t t = 0; t < QUAD; ++t) {
            const int64_t n = g * GROUP + c, k = q * QUAD + t;
            dst[((g * Q + q) * GROUP + c) * QUAD + t] = n < N && k < K ? src[n * K + k] : 0;
          }
  });
  return packed;
}

#if defined(SPECACTOR_INT8_KERNEL)

// One row of x -> Q quads of (xq + 128) bytes (pad 128: the padded weights are 0) and the row's scale.
float quantize_row(const float* x, int64_t K, int64_t Q, uint8_t* out) {
  __m512 peak = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) peak = _mm512_max_ps(peak, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
  float max = _mm512_reduce_max_ps(peak);
  for (; k < K; ++k) max = std::max(max, std::abs(x[k]));
  const float inv = max > 0.0f ? 127.0f / max : 0.0f;
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i bias = _mm512_set1_epi32(128);
  for (k = 0; k + 16 <= K; k += 16) {  // cvtps rounds half to even (the default MXCSR mode)
    const __m512i q = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), vinv)), bias);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), _mm512_cvtepi32_epi8(q));
  }
  for (; k < K; ++k) out[k] = static_cast<uint8_t>(static_cast<int32_t>(std::nearbyint(x[k] * inv)) + 128);
  for (; k < Q * QUAD; ++k) out[k] = 128;
  return max / 127.0f;
}

// rows x 32 columns of one group over every input quad; acc [rows][32] int32.
template <int ROWS>
inline void tile(const int32_t* x, int64_t Q, const __m512i* w, int32_t* acc) {
  __m512i lo[ROWS], hi[ROWS];
  for (int m = 0; m < ROWS; ++m) {
    lo[m] = _mm512_setzero_si512();
    hi[m] = _mm512_setzero_si512();
  }
  for (int64_t q = 0; q < Q; ++q) {
    _mm_prefetch(reinterpret_cast<const char*>(w + 2 * q + PREFETCH_AHEAD), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + 2 * q + 1 + PREFETCH_AHEAD), _MM_HINT_T0);
    const __m512i w0 = _mm512_load_si512(w + 2 * q), w1 = _mm512_load_si512(w + 2 * q + 1);
    for (int m = 0; m < ROWS; ++m) {
      const __m512i quad = _mm512_set1_epi32(x[m * Q + q]);  // 4 bytes of the row in every lane
      lo[m] = _mm512_dpbusd_epi32(lo[m], quad, w0);
      hi[m] = _mm512_dpbusd_epi32(hi[m], quad, w1);
    }
  }
  for (int m = 0; m < ROWS; ++m) {
    _mm512_storeu_si512(acc + m * GROUP, lo[m]);
    _mm512_storeu_si512(acc + m * GROUP + 16, hi[m]);
  }
}

using TileFn = void (*)(const int32_t*, int64_t, const __m512i*, int32_t*);
constexpr TileFn TILES[ROWS_PER_TILE + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>,
                                             tile<5>, tile<6>, tile<7>, tile<8>};

#endif

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const at::Tensor& colsum, const c10::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && packed.dim() == 4 &&
                  packed.scalar_type() == at::kChar && packed.size(2) == GROUP && packed.size(3) == QUAD,
              "int8_linear: expected x [M, K] float32 and a weight from int8_linear_pack");
  const int64_t M = x.size(0), K = x.size(1), G = packed.size(0), Q = packed.size(1), N = out_features;
  TORCH_CHECK(Q == (K + QUAD - 1) / QUAD && N > 0 && N <= G * GROUP, "int8_linear: x has ", K,
              " columns and the packed weight ", Q * QUAD, " (", N, " outputs of at most ", G * GROUP, ")");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == N && colsum.scalar_type() == at::kInt &&
                  colsum.numel() == N, "int8_linear: expected ", N, " float32 scales and int32 column sums");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == at::kFloat && bias->numel() == N),
              "int8_linear: expected a float32 bias of ", N, " values");
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
#if defined(SPECACTOR_INT8_KERNEL)
  const at::Tensor xc = x.contiguous(), sc = scale.contiguous(), cs = colsum.contiguous();
  const at::Tensor bc = has_bias ? bias->contiguous() : at::Tensor();
  // quantized rows [M][Q * 4] bytes and their scales, once per call
  std::vector<uint8_t> xq(M * Q * QUAD);
  std::vector<float> row_scale(M);
  const float* xf = xc.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) row_scale[m] = quantize_row(xf + m * K, K, Q, xq.data() + m * Q * QUAD);
  });
  const int32_t* x32 = reinterpret_cast<const int32_t*>(xq.data());
  const __m512i* w = reinterpret_cast<const __m512i*>(packed.data_ptr<int8_t>());
  const float* wscale = sc.data_ptr<float>();
  const int32_t* sums = cs.data_ptr<int32_t>();
  const float* bias_f = has_bias ? bc.data_ptr<float>() : nullptr;
  float* y = out.data_ptr<float>();
  // one contiguous range of groups per thread: each streams its part of the weight once per block of rows
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    std::vector<int32_t> acc(std::min(M, ROW_BLOCK) * GROUP);
    for (int64_t b0 = 0; b0 < M; b0 += ROW_BLOCK) {
      const int64_t rows_here = std::min(ROW_BLOCK, M - b0), tiles = (rows_here + ROWS_PER_TILE - 1) / ROWS_PER_TILE;
      for (int64_t g = g0; g < g1; ++g) {
        const __m512i* wg = w + g * Q * 2;
        for (int64_t t = 0, m0 = 0; t < tiles; ++t) {  // rows split evenly into tiles of at most 8
          const int64_t rows = (rows_here - m0) / (tiles - t);
          TILES[rows](x32 + (b0 + m0) * Q, Q, wg, acc.data() + m0 * GROUP);
          m0 += rows;
        }
        const int64_t n0 = g * GROUP, width = std::min<int64_t>(GROUP, N - n0);
        for (int64_t m = 0; m < rows_here; ++m) {
          const float s = row_scale[b0 + m];
          float* row = y + (b0 + m) * N + n0;
          for (int64_t c = 0; c < width; ++c) {
            const int32_t exact = acc[m * GROUP + c] - 128 * sums[n0 + c];
            const float value = static_cast<float>(exact) * (s * wscale[n0 + c]);
            row[c] = bias_f != nullptr ? value + bias_f[n0 + c] : value;
          }
        }
      }
    }
  });
#else
  TORCH_CHECK(false, "int8_linear: this build has no AVX-512 VNNI (use PyTorch's dynamic int8 linear)");
#endif
  return out;
}

bool int8_linear_supported() {
#if defined(SPECACTOR_INT8_KERNEL)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specactor, m) {
  m.def("int8_linear_pack(Tensor weight) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scale, Tensor colsum, Tensor? bias, int out_features) -> Tensor");
  m.def("int8_linear_supported() -> bool", &int8_linear_supported);
}

TORCH_LIBRARY_IMPL(specactor, CPU, m) {
  m.impl("int8_linear_pack", &int8_linear_pack);
  m.impl("int8_linear", &int8_linear);
}

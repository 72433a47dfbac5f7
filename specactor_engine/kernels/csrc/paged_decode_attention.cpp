// Attention of a few new queries per row against that row's slot of a static KV cache (CPU).
//
// q [R, T, H, D]; key/value cache [N, L, H_kv, D]; slots [R]; positions [R, T] (absolute).
// Query t of row r (head h, KV head h / (H / H_kv)) attends to keys [lo, positions[r, t]] of
// cache slot slots[r], where lo = 0, or positions[r, t] - window + 1 with a sliding window.
// Out [R, T, H, D] in q's dtype; scores, softmax and the weighted sum accumulate in float
// (double for double inputs).
//
// Why a kernel: torch's CPU attention reads the cache through a gather (a copy of every live
// row's keys and values per layer once the live slots stop being one contiguous range) and its
// flash kernel is tuned for long query blocks, not for 1..k+1 queries against hundreds of keys.
// Here one task per row reads each cached key and value of the row exactly once, for all of its
// queries, straight from the cache slot. Every query is computed by the same sequence of
// operations whatever the other rows and queries of the call: a token's attention output does
// not depend on whether it was decoded alone or verified in a block.
#include <torch/library.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/OpMathType.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
extern "C" __m512 _ZGVeN16v_expf(__m512);  // glibc's libmvec: expf on 16 lanes
#endif

namespace {

// sum_d a[d] * b[d]. GCC turns an `omp simd` reduction of a short loop into a vector loop and
// then sixteen dependent scalar adds; with AVX-512 the float case reduces in registers instead.
template <typename acc_t>
inline acc_t dot(const acc_t* a, const acc_t* b, int64_t n) {
  acc_t total = 0;
  for (int64_t d = 0; d < n; ++d) total += a[d] * b[d];
  return total;
}

#if defined(__AVX512F__)
template <>
inline float dot<float>(const float* a, const float* b, int64_t n) {
  __m512 sum = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), sum);
  float total = _mm512_reduce_add_ps(sum);
  for (; d < n; ++d) total += a[d] * b[d];
  return total;
}
#endif

// The cached row as accumulation-type values: itself when the types agree, else converted into `buffer`.
template <typename scalar_t, typename acc_t>
inline const acc_t* widen(const scalar_t* row, acc_t* buffer, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return row;
  } else {
    for (int64_t j = 0; j < n; ++j) buffer[j] = static_cast<acc_t>(row[j]);
    return buffer;
  }
}

// row[s] = exp(row[s] - max(row)) for s in [0, n); returns the sum (softmax's numerator and denominator).
template <typename acc_t>
inline acc_t exp_shifted(acc_t* row, int64_t n) {
  acc_t peak = row[0];
  for (int64_t s = 1; s < n; ++s) peak = std::max(peak, row[s]);
  acc_t total = 0;
  for (int64_t s = 0; s < n; ++s) {
    row[s] = std::exp(row[s] - peak);
    total += row[s];
  }
  return total;
}

#if defined(__AVX512F__)
// Scalar expf made up about half of the kernel's time at 5 queries per row: 16 lanes per call here.
template <>
inline float exp_shifted<float>(float* row, int64_t n) {
  __m512 peaks = _mm512_set1_ps(row[0]);
  int64_t s = 0;
  for (; s + 16 <= n; s += 16) peaks = _mm512_max_ps(peaks, _mm512_loadu_ps(row + s));
  float peak = _mm512_reduce_max_ps(peaks);
  for (; s < n; ++s) peak = std::max(peak, row[s]);
  const __m512 shift = _mm512_set1_ps(peak);
  __m512 sums = _mm512_setzero_ps();
  for (s = 0; s + 16 <= n; s += 16) {
    const __m512 w = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_loadu_ps(row + s), shift));
    _mm512_storeu_ps(row + s, w);
    sums = _mm512_add_ps(sums, w);
  }
  if (s < n) {
    const __mmask16 lanes = static_cast<__mmask16>((1u << (n - s)) - 1);
    const __m512 w = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, row + s), shift));
    _mm512_mask_storeu_ps(row + s, lanes, w);
    sums = _mm512_add_ps(sums, _mm512_maskz_mov_ps(lanes, w));
  }
  return _mm512_reduce_add_ps(sums);
}
#endif

template <typename scalar_t>
void attend(const scalar_t* q, const scalar_t* key_cache, const scalar_t* value_cache, const int64_t* slots,
            const int64_t* positions, scalar_t* out, int64_t R, int64_t T, int64_t H, int64_t H_kv, int64_t D,
            int64_t L, double scale, int64_t window) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t group = H / H_kv;
  const int64_t queries = H * T;  // per row; query i = (head h, new token t) with i = h * T + t
  const int64_t row_stride = H_kv * D;  // one cached position: every KV head, contiguous
  // One task per row: it streams the row's cached positions front to back (every KV head of a
  // position is one contiguous run), which the hardware prefetcher follows; a task per (row, KV
  // head) read strided runs and spent most of its time waiting on memory.
  at::parallel_for(0, R, 1, [=](int64_t begin, int64_t end) {
    std::vector<acc_t> qf(queries * D), acc(queries * D), kf(row_stride), scores, denom(queries);
    std::vector<int64_t> first(queries), last(queries), kv_offset(queries);
    for (int64_t i = 0; i < queries; ++i) kv_offset[i] = (i / T / group) * D;  // query i's KV head in a row
    for (int64_t r = begin; r < end; ++r) {
      const int64_t slot = slots[r];
      int64_t lo = positions[r * T], hi = lo;
      for (int64_t i = 0; i < queries; ++i) {
        const int64_t h = i / T, t = i % T;
        last[i] = positions[r * T + t];
        first[i] = window > 0 ? std::max<int64_t>(0, last[i] - window + 1) : 0;
        lo = std::min(lo, first[i]);
        hi = std::max(hi, last[i]);
        const scalar_t* qrow = q + ((r * T + t) * H + h) * D;
        for (int64_t d = 0; d < D; ++d) qf[i * D + d] = static_cast<acc_t>(qrow[d]) * static_cast<acc_t>(scale);
      }
      const int64_t S = hi - lo + 1;
      scores.assign(queries * S, acc_t(0));
      const scalar_t* keys = key_cache + (slot * L + lo) * row_stride;
      for (int64_t s = 0; s < S; ++s) {
        const acc_t* krow = widen(keys + s * row_stride, kf.data(), row_stride);
        for (int64_t i = 0; i < queries; ++i) {
          scores[i * S + s] = dot(qf.data() + i * D, krow + kv_offset[i], D);
        }
      }
      for (int64_t i = 0; i < queries; ++i) {  // softmax over each query's own key range [a, b]
        acc_t* row = scores.data() + i * S;
        const int64_t a = first[i] - lo, b = last[i] - lo;
        denom[i] = exp_shifted(row + a, b - a + 1);
        std::fill(row, row + a, acc_t(0));
        std::fill(row + b + 1, row + S, acc_t(0));
      }
      std::fill(acc.begin(), acc.end(), acc_t(0));
      const scalar_t* values = value_cache + (slot * L + lo) * row_stride;
      for (int64_t s = 0; s < S; ++s) {
        const acc_t* vrow = widen(values + s * row_stride, kf.data(), row_stride);
        for (int64_t i = 0; i < queries; ++i) {
          const acc_t w = scores[i * S + s];
          if (w == acc_t(0)) continue;
          const acc_t* vi = vrow + kv_offset[i];
          acc_t* ai = acc.data() + i * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ai[d] += w * vi[d];
        }
      }
      for (int64_t i = 0; i < queries; ++i) {
        const int64_t h = i / T, t = i % T;
        scalar_t* orow = out + ((r * T + t) * H + h) * D;
        const acc_t inv = acc_t(1) / denom[i];
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<scalar_t>(acc[i * D + d] * inv);
      }
    }
  });
}

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& key_cache,
                                     const torch::Tensor& value_cache, const torch::Tensor& slots,
                                     const torch::Tensor& positions, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 4 && key_cache.dim() == 4 && value_cache.dim() == 4, "q [R,T,H,D], caches [N,L,H_kv,D]");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "key and value caches differ in shape");
  TORCH_CHECK(q.scalar_type() == key_cache.scalar_type() && q.scalar_type() == value_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && positions.scalar_type() == torch::kLong, "int64 indices");
  const int64_t R = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t L = key_cache.size(1), H_kv = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == D && H % H_kv == 0, "head sizes do not match");
  TORCH_CHECK(slots.numel() == R && positions.size(0) == R && positions.size(1) == T, "slots [R], positions [R,T]");
  auto qc = q.contiguous();
  auto sc = slots.contiguous();
  auto pc = positions.contiguous();
  const int64_t* slot_data = sc.data_ptr<int64_t>();
  const int64_t* position_data = pc.data_ptr<int64_t>();
  for (int64_t i = 0; i < R * T; ++i) {
    TORCH_CHECK(position_data[i] >= 0 && position_data[i] < L, "positions outside the cache: ", position_data[i],
                " not in [0, ", L, ")");
  }
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(slot_data[r] >= 0 && slot_data[r] < key_cache.size(0), "slot outside the cache: ", slot_data[r]);
  }
  auto out = torch::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    attend<scalar_t>(qc.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(),
                     slot_data, position_data, out.data_ptr<scalar_t>(), R, T, H, H_kv, D, L,
                     scale, window);
  });
  return out;
}

}  // namespace

// A torch operator (not a bare Python binding), so profilers see it and torch.compile can trace around it.
TORCH_LIBRARY(specactor, m) {
  m.def("paged_decode_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor slots, Tensor positions, "
        "float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(specactor, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }

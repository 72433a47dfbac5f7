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
#include <utility>
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

// The `queries` queries of row r from head `head0` on (query i: head head0 + i / T, new token i % T): each one's
// key range [first[i], last[i]] (its own position, back `window` positions or to the start) and its copy
// scaled by `scale` in qf[i * D, (i + 1) * D). Returns the range every query's keys lie in, [lo, hi].
template <typename scalar_t, typename acc_t>
std::pair<int64_t, int64_t> load_queries(const scalar_t* q, const int64_t* positions, int64_t r, int64_t head0,
                                         int64_t queries, int64_t T, int64_t H, int64_t D, double scale,
                                         int64_t window, acc_t* qf, int64_t* first, int64_t* last) {
  int64_t lo = positions[r * T], hi = lo;
  for (int64_t i = 0; i < queries; ++i) {
    const int64_t h = head0 + i / T, t = i % T;
    last[i] = positions[r * T + t];
    first[i] = window > 0 ? std::max<int64_t>(0, last[i] - window + 1) : 0;
    lo = std::min(lo, first[i]);
    hi = std::max(hi, last[i]);
    const scalar_t* qrow = q + ((r * T + t) * H + h) * D;
    for (int64_t d = 0; d < D; ++d) qf[i * D + d] = static_cast<acc_t>(qrow[d]) * static_cast<acc_t>(scale);
  }
  return {lo, hi};
}

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
      const auto [lo, hi] = load_queries(q, positions, r, 0, queries, T, H, D, scale, window, qf.data(),
                                         first.data(), last.data());
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

#if defined(__AVX512F__)
// Sixteen float lanes of a cached row: float as is, bfloat16 widened (its bits are a float's top half).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// The lane sums of 16 vectors as one vector: out[j] = sum of v[j]'s lanes. Every input goes through the
// same tree (pairs of lanes 2 apart, then of 128-bit blocks), so a sum does not depend on its slot.
inline __m512 lane_sums16(const __m512* v) {
  __m512 pair[8], quad[4], half[2];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j)  // per 128-bit block: (x0 + x2, x1 + x3) of v[2j] and v[2j+1], interleaved
    pair[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j)  // per 128-bit block: the block sum of v[4j..4j+3]
    quad[j] = _mm512_add_ps(_mm512_shuffle_ps(pair[2 * j], pair[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_ps(pair[2 * j], pair[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
#pragma GCC unroll 2
  for (int j = 0; j < 2; ++j)  // blocks (0 + 1), (2 + 3) of quad[2j], then of quad[2j+1]
    half[j] = _mm512_add_ps(_mm512_shuffle_f32x4(quad[2 * j], quad[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_f32x4(quad[2 * j], quad[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(half[0], half[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(half[0], half[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Ask for the next block's rows (one head's D values each) while this block is computed: a task reads one KV
// head's half of every cached position, runs the hardware prefetcher does not follow far enough ahead.
template <typename scalar_t>
inline void prefetch_rows(const scalar_t* first, int64_t rows, int64_t stride, int64_t D) {
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t byte = 0; byte < D * static_cast<int64_t>(sizeof(scalar_t)); byte += 64)
      _mm_prefetch(reinterpret_cast<const char*>(first + j * stride) + byte, _MM_HINT_T0);
}

constexpr int64_t KEY_BLOCK = 16;  // keys widened at a time (and the scores one lane_sums16 gives)
constexpr int64_t QUERY_TILE = 4;  // queries whose weighted sums share each loaded value vector
constexpr int64_t CHUNK_TILE = 4;  // 16-float chunks of the head those sums keep in registers

// acc[i][c] += w_i * V[s][c] for the tile's queries and chunks, s over one key block, in key order.
template <int64_t NQ, int64_t NC>
inline void weigh_values(const float* scores, int64_t score_stride, const float* vb, int64_t D, int64_t keys,
                         float* acc, int64_t c0) {
  __m512 sum[NQ][NC];
#pragma GCC unroll 4
  for (int64_t i = 0; i < NQ; ++i)
#pragma GCC unroll 4
    for (int64_t c = 0; c < NC; ++c) sum[i][c] = _mm512_loadu_ps(acc + i * D + (c0 + c) * 16);
  for (int64_t s = 0; s < keys; ++s) {
    __m512 value[NC];
#pragma GCC unroll 4
    for (int64_t c = 0; c < NC; ++c) value[c] = _mm512_loadu_ps(vb + s * D + (c0 + c) * 16);
#pragma GCC unroll 4
    for (int64_t i = 0; i < NQ; ++i) {
      const __m512 w = _mm512_set1_ps(scores[i * score_stride + s]);
#pragma GCC unroll 4
      for (int64_t c = 0; c < NC; ++c) sum[i][c] = _mm512_fmadd_ps(w, value[c], sum[i][c]);
    }
  }
#pragma GCC unroll 4
  for (int64_t i = 0; i < NQ; ++i)
#pragma GCC unroll 4
    for (int64_t c = 0; c < NC; ++c) _mm512_storeu_ps(acc + i * D + (c0 + c) * 16, sum[i][c]);
}

// `attend` for float and bfloat16 caches with head sizes in whole vectors, blocked for AVX-512: one task per
// (row, KV head); its keys are widened 16 at a time into a float block that every query of the head group
// reads (16 dot products a query, summed by one lane_sums16), and each value block is widened once and added
// into the queries' sums in tiles held in registers. A query's arithmetic (its dot products' lane order and
// tree, its softmax, its key-ordered sum of values, zero weights included) is the same whatever the call.
template <typename scalar_t>
void attend_blocked(const scalar_t* q, const scalar_t* key_cache, const scalar_t* value_cache, const int64_t* slots,
                    const int64_t* positions, scalar_t* out, int64_t R, int64_t T, int64_t H, int64_t H_kv, int64_t D,
                    int64_t L, double scale, int64_t window) {
  const int64_t group = H / H_kv;
  const int64_t queries = group * T;  // per (row, KV head); query i = (head g * group + i / T, new token i % T)
  const int64_t row_stride = H_kv * D;
  const int64_t chunks = D / 16;
  at::parallel_for(0, R * H_kv, 1, [=](int64_t begin, int64_t end) {
    std::vector<float> qf(queries * D), acc(queries * D), block(KEY_BLOCK * D), scores, denom(queries);
    std::vector<int64_t> first(queries), last(queries);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / H_kv, g = task % H_kv, slot = slots[r];
      const auto [lo, hi] = load_queries(q, positions, r, g * group, queries, T, H, D, scale, window, qf.data(),
                                         first.data(), last.data());
      const int64_t S = hi - lo + 1, padded = (S + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
      scores.assign(queries * padded, 0.0f);
      const scalar_t* keys = key_cache + (slot * L + lo) * row_stride + g * D;
      const scalar_t* values = value_cache + (slot * L + lo) * row_stride + g * D;
      for (int64_t s0 = 0; s0 < S; s0 += KEY_BLOCK) {  // scores, 16 keys at a time
        const int64_t n = std::min(KEY_BLOCK, S - s0);
        std::fill(block.begin() + n * D, block.end(), 0.0f);
        prefetch_rows(keys + (s0 + KEY_BLOCK) * row_stride, std::min(KEY_BLOCK, S - s0 - KEY_BLOCK), row_stride, D);
        for (int64_t j = 0; j < n; ++j)
          for (int64_t c = 0; c < chunks; ++c)
            _mm512_storeu_ps(block.data() + j * D + c * 16, load16(keys + (s0 + j) * row_stride + c * 16));
        for (int64_t i = 0; i < queries; ++i) {
          __m512 dots[KEY_BLOCK];
#pragma GCC unroll 16
          for (int64_t j = 0; j < KEY_BLOCK; ++j) dots[j] = _mm512_setzero_ps();
          for (int64_t c = 0; c < chunks; ++c) {
            const __m512 qv = _mm512_loadu_ps(qf.data() + i * D + c * 16);
#pragma GCC unroll 16
            for (int64_t j = 0; j < KEY_BLOCK; ++j)
              dots[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(block.data() + j * D + c * 16), dots[j]);
          }
          _mm512_storeu_ps(scores.data() + i * padded + s0, lane_sums16(dots));
        }
      }
      for (int64_t i = 0; i < queries; ++i) {  // softmax over each query's own key range [a, b]
        float* row = scores.data() + i * padded;
        const int64_t a = first[i] - lo, b = last[i] - lo;
        denom[i] = exp_shifted(row + a, b - a + 1);
        std::fill(row, row + a, 0.0f);
        std::fill(row + b + 1, row + padded, 0.0f);
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t s0 = 0; s0 < S; s0 += KEY_BLOCK) {  // weighted values, 16 keys at a time
        const int64_t n = std::min(KEY_BLOCK, S - s0);
        prefetch_rows(values + (s0 + KEY_BLOCK) * row_stride, std::min(KEY_BLOCK, S - s0 - KEY_BLOCK), row_stride, D);
        for (int64_t j = 0; j < n; ++j)
          for (int64_t c = 0; c < chunks; ++c)
            _mm512_storeu_ps(block.data() + j * D + c * 16, load16(values + (s0 + j) * row_stride + c * 16));
        int64_t i = 0;
        for (; i + QUERY_TILE <= queries; i += QUERY_TILE) {
          const float* w = scores.data() + i * padded + s0;
          int64_t c = 0;
          for (; c + CHUNK_TILE <= chunks; c += CHUNK_TILE)
            weigh_values<QUERY_TILE, CHUNK_TILE>(w, padded, block.data(), D, n, acc.data() + i * D, c);
          for (; c < chunks; ++c) weigh_values<QUERY_TILE, 1>(w, padded, block.data(), D, n, acc.data() + i * D, c);
        }
        for (; i < queries; ++i) {
          const float* w = scores.data() + i * padded + s0;
          int64_t c = 0;
          for (; c + CHUNK_TILE <= chunks; c += CHUNK_TILE)
            weigh_values<1, CHUNK_TILE>(w, padded, block.data(), D, n, acc.data() + i * D, c);
          for (; c < chunks; ++c) weigh_values<1, 1>(w, padded, block.data(), D, n, acc.data() + i * D, c);
        }
      }
      for (int64_t i = 0; i < queries; ++i) {
        const int64_t h = g * group + i / T, t = i % T;
        scalar_t* orow = out + ((r * T + t) * H + h) * D;
        const float inv = 1.0f / denom[i];
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<scalar_t>(acc[i * D + d] * inv);
      }
    }
  });
}
#endif

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
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
      if (D % 16 == 0) {
        attend_blocked<scalar_t>(qc.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(),
                                 value_cache.data_ptr<scalar_t>(), slot_data, position_data,
                                 out.data_ptr<scalar_t>(), R, T, H, H_kv, D, L, scale, window);
        return;
      }
    }
#endif
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

// Position-keyed Gumbel-max in one pass over each row's scores (CPU, AVX-512).
//
//   out[n] = argmax_v(scores[n, v] + g(n, v)),  g = -log(-log(u)),  u = ((mix32(keys[n] ^ token_hash[v]) >> 9)
//            + 0.5) * 2^-23
//
// the arithmetic of `gumbel_argmax_reference` (specactor_engine/kernels/gumbel_argmax.py), bit for bit: the hash
// in 32-bit lanes (the reference keeps 32-bit values in int64 and masks every product, which is the same bits),
// both logs by Sleef's logf (u10), which is what torch.log and TorchInductor's vectorised code call on an AVX-512
// CPU, and torch.argmax's rule (the first index of the maximum; a NaN counts as the maximum). bfloat16 scores are
// widened on the fly (exactly, as `.float()` does). TorchInductor's compiled reference ran the hash in 64-bit
// lanes, 8 to a vector, and read a float copy of half-precision logits: ~5 ms of a 4-row, 3-token verify round
// on Qwen's 151,936-token vocabulary.
#include <torch/library.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
extern "C" __m512 Sleef_logf16_u10(__m512);  // libtorch_cpu's Sleef: torch.log's float kernel on AVX-512

namespace {

inline __m512i mix32(__m512i x) {  // counter_hash.mix32 on 16 lanes of uint32
  const __m512i a = _mm512_set1_epi32(0x7FEB352D), b = _mm512_set1_epi32(0x5BD1E995);
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, a);
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, b);
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, a);
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
}

inline __m512 load_scores(const float* p, __mmask16 lanes) { return _mm512_maskz_loadu_ps(lanes, p); }
inline __m512 load_scores(const c10::BFloat16* p, __mmask16 lanes) {
  const __m256i raw = _mm256_maskz_loadu_epi16(lanes, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// The low 32 bits of 16 int64 token hashes.
inline __m512i load_hashes(const int64_t* p, __mmask16 lanes) {
  const __m256i lo = _mm512_cvtepi64_epi32(_mm512_maskz_loadu_epi64(static_cast<__mmask8>(lanes), p));
  const __m256i hi = _mm512_cvtepi64_epi32(_mm512_maskz_loadu_epi64(static_cast<__mmask8>(lanes >> 8), p + 8));
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

struct Best {
  float value;
  int64_t index;
};

// a beats b in torch.argmax's order (a found later than b): greater, or NaN where b is not.
inline bool beats(float a, float b) { return a > b || (std::isnan(a) && !std::isnan(b)); }

// scores[v] + noise at the 16 positions from v (lanes past `lanes` are garbage).
template <typename scalar_t>
inline __m512 noisy(const scalar_t* scores, const int64_t* token_hash, __m512i key_v, int64_t v, __mmask16 lanes) {
  const __m512 half = _mm512_set1_ps(0.5f), step = _mm512_set1_ps(1.1920928955078125e-07f);
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m512i bits = mix32(_mm512_xor_si512(key_v, load_hashes(token_hash + v, lanes)));
  const __m512 uniform = _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bits, 9)), half), step);
  const __m512 inner = _mm512_xor_ps(Sleef_logf16_u10(uniform), sign);  // -log(u)
  const __m512 gumbel = _mm512_xor_ps(Sleef_logf16_u10(inner), sign);   // -log(-log(u))
  return _mm512_add_ps(load_scores(scores + v, lanes), gumbel);
}

inline __mmask16 lanes_from(int64_t v, int64_t end) {
  return end - v >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (end - v)) - 1);
}

// No noise exceeds this: u <= 1 - 2^-24 gives -log(-log(u)) <= 16.64 (Sleef's logf is within an ulp).
constexpr float GUMBEL_BOUND = 16.7f;

// Best of scores[begin, end) + noise, in the order torch.argmax scans. `floor` is a total some token of the row
// reaches: a 16-token block whose every score s has s + GUMBEL_BOUND < floor (in float, whose rounding keeps the
// order) cannot hold the maximum, and its noise is not computed. At T = 1 most of a vocabulary's logits sit far
// below the best one's.
template <typename scalar_t>
Best scan(const scalar_t* scores, const int64_t* token_hash, uint32_t key, int64_t begin, int64_t end, float floor) {
  const __m512i key_v = _mm512_set1_epi32(static_cast<int>(key));
  const __m512 cut = _mm512_set1_ps(floor), bound = _mm512_set1_ps(GUMBEL_BOUND);
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i best_index = _mm512_set1_epi32(-1);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t v = begin; v < end; v += 16) {
    const __mmask16 lanes = lanes_from(v, end);
    // NaN scores compare false here, so a block holding one is never skipped
    if (_mm512_mask_cmp_ps_mask(lanes, _mm512_add_ps(load_scores(scores + v, lanes), bound), cut, _CMP_LT_OQ) == lanes)
      continue;
    const __m512 total = noisy(scores, token_hash, key_v, v, lanes);
    // per lane: take the new value where it beats the lane's best (NaN beats a number; ties keep the earlier)
    const __mmask16 greater = _mm512_cmp_ps_mask(total, best, _CMP_GT_OQ);
    const __mmask16 nan_new = _mm512_cmp_ps_mask(total, total, _CMP_UNORD_Q);
    const __mmask16 nan_old = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
    const __mmask16 take = lanes & (greater | (nan_new & ~nan_old));
    best = _mm512_mask_mov_ps(best, take, total);
    best_index = _mm512_mask_mov_epi32(best_index, take, _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(v))));
  }
  alignas(64) float values[16];
  alignas(64) int32_t indices[16];
  _mm512_store_ps(values, best);
  _mm512_store_si512(reinterpret_cast<__m512i*>(indices), best_index);
  Best out{-std::numeric_limits<float>::infinity(), -1};
  for (int j = 0; j < 16; ++j) {  // the lanes' bests: the greatest, then the lowest index among equals
    if (indices[j] < 0) continue;
    if (out.index < 0 || beats(values[j], out.value) ||
        (indices[j] < out.index && !beats(out.value, values[j]))) {
      out = {values[j], indices[j]};
    }
  }
  return out;
}

// The total (score + noise) of the row's highest score: a floor for `scan`'s skipping (-inf: skip nothing).
template <typename scalar_t>
float floor_of(const scalar_t* scores, const int64_t* token_hash, uint32_t key, int64_t V) {
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t v = 0; v < V; v += 16) {
    const __mmask16 lanes = lanes_from(v, V);
    top = _mm512_mask_max_ps(top, lanes, top, load_scores(scores + v, lanes));
  }
  const float highest = _mm512_reduce_max_ps(top);
  if (!std::isfinite(highest)) return -std::numeric_limits<float>::infinity();
  for (int64_t v = 0; v < V; v += 16) {
    const __mmask16 lanes = lanes_from(v, V);
    const __mmask16 at = _mm512_mask_cmp_ps_mask(lanes, load_scores(scores + v, lanes), _mm512_set1_ps(highest),
                                                 _CMP_EQ_OQ);
    if (at) {
      alignas(64) float totals[16];
      _mm512_store_ps(totals, noisy(scores, token_hash, _mm512_set1_epi32(static_cast<int>(key)), v, lanes));
      return totals[__builtin_ctz(at)];
    }
  }
  return -std::numeric_limits<float>::infinity();
}

torch::Tensor gumbel_argmax(const torch::Tensor& scores, const torch::Tensor& keys, const torch::Tensor& token_hash) {
  TORCH_CHECK(scores.dim() == 2 && keys.dim() == 1 && token_hash.dim() == 1, "scores [N, V], keys [N], token_hash [V]");
  TORCH_CHECK(scores.size(0) == keys.size(0) && scores.size(1) == token_hash.size(0), "shapes do not match");
  TORCH_CHECK(scores.scalar_type() == torch::kFloat || scores.scalar_type() == torch::kBFloat16,
              "scores must be float32 or bfloat16");
  TORCH_CHECK(keys.scalar_type() == torch::kLong && token_hash.scalar_type() == torch::kLong, "int64 keys and hashes");
  TORCH_CHECK(scores.size(1) < (int64_t{1} << 31), "a vocabulary over 2^31 tokens");
  auto sc = scores.contiguous();
  auto kc = keys.contiguous();
  auto hc = token_hash.contiguous();
  const int64_t N = sc.size(0), V = sc.size(1);
  auto out = torch::empty({N}, keys.options());
  if (N == 0) return out;
  // a few rows (a decode step's) split each row's vocabulary among the threads; parts merged in order
  const int64_t threads = at::get_num_threads();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>((threads + N - 1) / N, V / 4096));
  const int64_t part_len = (V + parts - 1) / parts / 16 * 16 + 16;
  std::vector<Best> found(N * parts);
  std::vector<float> floors(N);
  const int64_t* key_data = kc.data_ptr<int64_t>();
  const int64_t* hash_data = hc.data_ptr<int64_t>();
  auto search = [&](const auto* data) {  // each row's floor, then its parts
    at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n)
        floors[n] = floor_of(data + n * V, hash_data, static_cast<uint32_t>(key_data[n]), V);
    });
    at::parallel_for(0, N * parts, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t n = task / parts, p = task % parts;
        const int64_t lo = std::min(V, p * part_len), hi = std::min(V, lo + part_len);
        found[task] = scan(data + n * V, hash_data, static_cast<uint32_t>(key_data[n]), lo, hi, floors[n]);
      }
    });
  };
  if (sc.scalar_type() == torch::kFloat) {
    search(sc.data_ptr<float>());
  } else {
    search(sc.data_ptr<c10::BFloat16>());
  }
  int64_t* out_data = out.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) {
    Best best{0.0f, -1};
    for (int64_t p = 0; p < parts; ++p) {  // parts in vocabulary order: a later part must beat, not tie
      const Best& part = found[n * parts + p];
      if (part.index >= 0 && (best.index < 0 || beats(part.value, best.value))) best = part;
    }
    out_data[n] = best.index;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specactor, m) {
  m.def("gumbel_argmax(Tensor scores, Tensor keys, Tensor token_hash) -> Tensor");
}

TORCH_LIBRARY_IMPL(specactor, CPU, m) { m.impl("gumbel_argmax", &gumbel_argmax); }
#endif

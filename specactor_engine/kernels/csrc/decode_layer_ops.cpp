// The elementwise work of a decoder layer, one pass per step instead of one torch op per step (CPU).
//
// At a few rows per forward a decoder layer's linears stream its weights and everything else is
// small: RMSNorm, rotary embedding, the KV cache write, SiLU-and-multiply and the residual adds
// were ~35 torch ops per layer, ~12% of a 4-row Qwen2.5-1.5B decode step, almost all of it
// dispatch. Here they are four ops per layer:
//
//   rms_norm(x, w, eps)                    Hugging Face's RMSNorm: w * (x / sqrt(mean(x^2) + eps))
//   add_rms_norm(h, delta, w, eps)         (h + delta, rms_norm(h + delta, w, eps)): residual + next norm
//   rotary_write_kv(qkv, cos, sin, ...)    rotary on q and k of a fused q|k|v projection, k and v
//                                          written to the cache at (slot, position); returns q
//   silu_mul(gate_up)                      silu(gate) * up of a fused gate|up projection
//
// Numerics follow the torch ops they replace (specactor_engine/kernels/decode_ops.py has them as
// references): each torch op's rounding to the tensor dtype happens here too, in the same order
// (bf16: compute in float, round to bf16 after every op torch rounds after), so rotary, the adds
// and the cache write are bit-identical to torch's. The norm's mean sums in a fixed order of its
// own (torch's vectorised sum orders differently: results agree to float rounding), and SiLU's exp
// is glibc's (torch's is Sleef's, within an ulp). Every token is computed by the same operations
// whatever the other rows and tokens of the call: a token's result does not depend on the block
// width or the batch, which is what keeps verification and plain decoding identical.
#include <torch/library.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/OpMathType.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
extern "C" __m512 _ZGVeN16v_expf(__m512);  // glibc's libmvec: expf on 16 lanes
#endif

// a * b + c must round twice, as torch's separate ops do: no fused multiply-add contraction here
#pragma GCC optimize("fp-contract=off")

namespace {

// Tokens per parallel task: a decode step's handful of tokens runs inline (no thread wake-up).
constexpr int64_t NORM_GRAIN = 64;
constexpr int64_t SILU_GRAIN_ELEMENTS = 1 << 16;  // outputs per task
constexpr int LANES = 16;

template <typename scalar_t>
using opmath = at::opmath_type<scalar_t>;

// sum of x[i]^2 in float, in LANES interleaved partial sums (a vectorisable fixed order), then in lane order.
template <typename scalar_t>
inline float sum_squares(const scalar_t* x, int64_t n) {
  float partial[LANES] = {};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    for (int j = 0; j < LANES; ++j) {
      const float v = static_cast<float>(x[i + j]);
      partial[j] += v * v;
    }
  }
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    partial[0] += v * v;
  }
  float total = 0.0f;
  for (int j = 0; j < LANES; ++j) total += partial[j];
  return total;
}

// out = w * (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(dtype), as transformers' Llama/Qwen2/Qwen3/Mistral RMSNorm
template <typename scalar_t>
inline void norm_row(const scalar_t* x, const scalar_t* w, scalar_t* out, int64_t n, float eps) {
  using acc_t = opmath<scalar_t>;
  const float variance = sum_squares(x, n) / static_cast<float>(n);
  const float inv = 1.0f / std::sqrt(variance + eps);
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t normed = static_cast<scalar_t>(static_cast<float>(x[i]) * inv);
    out[i] = static_cast<scalar_t>(static_cast<acc_t>(w[i]) * static_cast<acc_t>(normed));
  }
}

void check_norm_args(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && x.size(-1) == weight.size(0),
              "x [..., d] and weight [d] expected, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must share a dtype");
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto out = torch::empty_like(xc);
  const int64_t d = xc.size(-1), tokens = d ? xc.numel() / d : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "rms_norm", [&] {
    const scalar_t *xp = xc.data_ptr<scalar_t>(), *wp = wc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, NORM_GRAIN, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) norm_row(xp + t * d, wp, op + t * d, d, static_cast<float>(eps));
    });
  });
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& h, const torch::Tensor& delta,
                                                      const torch::Tensor& weight, double eps) {
  check_norm_args(h, weight);
  TORCH_CHECK(h.sizes() == delta.sizes() && h.scalar_type() == delta.scalar_type(),
              "h and delta must match in shape and dtype, got ", h.sizes(), " and ", delta.sizes());
  auto hc = h.contiguous();
  auto dc = delta.contiguous();
  auto wc = weight.contiguous();
  auto sum = torch::empty_like(hc);
  auto out = torch::empty_like(hc);
  const int64_t d = hc.size(-1), tokens = d ? hc.numel() / d : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hc.scalar_type(), "add_rms_norm", [&] {
    using acc_t = opmath<scalar_t>;
    const scalar_t *hp = hc.data_ptr<scalar_t>(), *dp = dc.data_ptr<scalar_t>(), *wp = wc.data_ptr<scalar_t>();
    scalar_t *sp = sum.data_ptr<scalar_t>(), *op = out.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, NORM_GRAIN, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t i = t * d; i < (t + 1) * d; ++i) {
          sp[i] = static_cast<scalar_t>(static_cast<acc_t>(hp[i]) + static_cast<acc_t>(dp[i]));
        }
        norm_row(sp + t * d, wp, op + t * d, d, static_cast<float>(eps));
      }
    });
  });
  return {sum, out};
}

// out[i] = x[i] * cos[i] + rotate_half(x)[i] * sin[i], each product and the sum rounded to the dtype
// (rotate_half(x) = cat(-x[D/2:], x[:D/2])), as runner.apply_rotary computes it with torch ops.
template <typename scalar_t>
inline void rotate(const scalar_t* x, const scalar_t* cos, const scalar_t* sin, scalar_t* out, int64_t D) {
  using acc_t = opmath<scalar_t>;
  const int64_t half = D / 2;
  for (int64_t i = 0; i < D; ++i) {
    const acc_t rotated = i < half ? -static_cast<acc_t>(x[i + half]) : static_cast<acc_t>(x[i - half]);
    const scalar_t a = static_cast<scalar_t>(static_cast<acc_t>(x[i]) * static_cast<acc_t>(cos[i]));
    const scalar_t b = static_cast<scalar_t>(rotated * static_cast<acc_t>(sin[i]));
    out[i] = static_cast<scalar_t>(static_cast<acc_t>(a) + static_cast<acc_t>(b));
  }
}

torch::Tensor rotary_write_kv(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                              const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                              const torch::Tensor& slots, const torch::Tensor& positions, int64_t num_heads) {
  TORCH_CHECK(qkv.dim() == 3 && cos.dim() == 3 && sin.dim() == 3, "qkv [R,T,(H+2H_kv)D], cos/sin [R,T,D]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(), "caches [N,L,H_kv,D], equal");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype && key_cache.scalar_type() == dtype &&
              value_cache.scalar_type() == dtype, "qkv, cos, sin and the caches must share a dtype");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && positions.scalar_type() == torch::kLong, "int64 indices");
  const int64_t R = qkv.size(0), T = qkv.size(1), N = key_cache.size(0), L = key_cache.size(1);
  const int64_t H_kv = key_cache.size(2), D = key_cache.size(3), H = num_heads;
  TORCH_CHECK(D % 2 == 0 && qkv.size(2) == (H + 2 * H_kv) * D, "qkv's last dim must be (H + 2 H_kv) D = ",
              (H + 2 * H_kv) * D, ", got ", qkv.size(2));
  TORCH_CHECK(cos.size(0) == R && cos.size(1) == T && cos.size(2) == D && sin.sizes() == cos.sizes(),
              "cos/sin [R,T,D] expected, got ", cos.sizes());
  TORCH_CHECK(slots.numel() == R && positions.dim() == 2 && positions.size(0) == R && positions.size(1) == T,
              "slots [R], positions [R,T]");
  auto qc = qkv.contiguous();
  auto cc = cos.contiguous();
  auto sc = sin.contiguous();
  auto slot_c = slots.contiguous();
  auto pos_c = positions.contiguous();
  const int64_t* slot_data = slot_c.data_ptr<int64_t>();
  const int64_t* position_data = pos_c.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(slot_data[r] >= 0 && slot_data[r] < N, "slot outside the cache: ", slot_data[r]);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t p = position_data[r * T + t];
      TORCH_CHECK(p >= 0 && p < L, "positions outside the cache: ", p, " not in [0, ", L, ")");
    }
  }
  auto q = torch::empty({R, T, H, D}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "rotary_write_kv", [&] {
    const scalar_t *src = qc.data_ptr<scalar_t>(), *cp = cc.data_ptr<scalar_t>(), *sp = sc.data_ptr<scalar_t>();
    scalar_t *qp = q.data_ptr<scalar_t>(), *kp = key_cache.data_ptr<scalar_t>(), *vp = value_cache.data_ptr<scalar_t>();
    const int64_t width = (H + 2 * H_kv) * D;
    at::parallel_for(0, R * T, NORM_GRAIN, [&](int64_t begin, int64_t end) {
      for (int64_t token = begin; token < end; ++token) {
        const int64_t r = token / T;
        const scalar_t* row = src + token * width;
        const scalar_t *c = cp + token * D, *s = sp + token * D;
        for (int64_t h = 0; h < H; ++h) rotate(row + h * D, c, s, qp + (token * H + h) * D, D);
        const int64_t at = (slot_data[r] * L + position_data[token]) * H_kv * D;  // [slot, position, :, :]
        for (int64_t h = 0; h < H_kv; ++h) rotate(row + (H + h) * D, c, s, kp + at + h * D, D);
        std::copy(row + (H + H_kv) * D, row + width, vp + at);
      }
    });
  });
  return q;
}

#if defined(__AVX512F__)
// 16 floats from 16 of the dtype's values
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bf16 is the top half of a float
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
// Rounded to the dtype (bf16: to nearest, ties to even, as c10::BFloat16(float) rounds a finite value), and back.
inline __m512 round16(__m512 x, float*) { return x; }
inline __m512 round16(__m512 x, c10::BFloat16*) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(c10::BFloat16* p, __m512 x) {  // x already rounded: keep the top halves
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
}
#endif

// silu(g) = g / (1 + exp(-g)) in float, rounded to the dtype, then times up, rounded (torch: silu, then mul)
template <typename scalar_t>
inline void silu_mul_row(const scalar_t* gate, const scalar_t* up, scalar_t* out, int64_t n) {
  using acc_t = opmath<scalar_t>;
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + LANES <= n; i += LANES) {
      const __m512 x = load16(gate + i);
      const __m512 act = round16(_mm512_div_ps(x, _mm512_add_ps(one, _ZGVeN16v_expf(_mm512_sub_ps(_mm512_setzero_ps(), x)))),
                                 out);
      store16(out + i, round16(_mm512_mul_ps(act, load16(up + i)), out));
    }
  }
#endif
  for (; i < n; ++i) {
    const acc_t x = static_cast<acc_t>(gate[i]);
    const scalar_t act = static_cast<scalar_t>(x / (acc_t(1) + std::exp(-x)));
    out[i] = static_cast<scalar_t>(static_cast<acc_t>(act) * static_cast<acc_t>(up[i]));
  }
}

torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "gate_up [..., 2I] expected, got ", gate_up.sizes());
  auto gc = gate_up.contiguous();
  const int64_t n = gc.size(-1) / 2, tokens = n ? gc.numel() / (2 * n) : 0;
  auto shape = gc.sizes().vec();
  shape.back() = n;
  auto out = torch::empty(shape, gc.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gc.scalar_type(), "silu_mul", [&] {
    const scalar_t* gp = gc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, std::max<int64_t>(1, SILU_GRAIN_ELEMENTS / std::max<int64_t>(n, 1)),
                     [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) silu_mul_row(gp + t * 2 * n, gp + t * 2 * n + n, op + t * n, n);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specactor, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor h, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_write_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slots, Tensor positions, int num_heads) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(specactor, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_write_kv", &rotary_write_kv);
  m.impl("silu_mul", &silu_mul);
}

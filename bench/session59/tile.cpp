#include <immintrin.h>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <vector>
#include <random>
#include <time.h>
#include <omp.h>
static double now(){timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
constexpr int64_t GROUP=32; constexpr int64_t AHEAD=128;
template <int ROWS>
inline void tile_dp(const int32_t* x, int64_t P, const __m512bh* w, float* acc) {
  __m512 lo[ROWS], hi[ROWS];
  for (int m = 0; m < ROWS; ++m) { lo[m] = _mm512_setzero_ps(); hi[m] = _mm512_setzero_ps(); }
  for (int64_t p = 0; p < P; ++p) {
    _mm_prefetch((const char*)(w + 2 * p + AHEAD), _MM_HINT_T0);
    _mm_prefetch((const char*)(w + 2 * p + 1 + AHEAD), _MM_HINT_T0);
    const __m512bh w0 = w[2 * p], w1 = w[2 * p + 1];
    for (int m = 0; m < ROWS; ++m) {
      const __m512bh pair = (__m512bh)_mm512_set1_epi32(x[m * P + p]);
      lo[m] = _mm512_dpbf16_ps(lo[m], pair, w0);
      hi[m] = _mm512_dpbf16_ps(hi[m], pair, w1);
    }
  }
  for (int m = 0; m < ROWS; ++m) { _mm512_storeu_ps(acc + m * GROUP, lo[m]); _mm512_storeu_ps(acc + m * GROUP + 16, hi[m]); }
}
// xf: [ROWS][P][2] fp32: (odd, even) i.e. x[2p+1], x[2p]
template <int ROWS>
inline void tile_fma(const float* xf, int64_t P, const __m512i* w, float* acc) {
  __m512 lo[ROWS], hi[ROWS];
  for (int m = 0; m < ROWS; ++m) { lo[m] = _mm512_setzero_ps(); hi[m] = _mm512_setzero_ps(); }
  const __m512i himask = _mm512_set1_epi32((int)0xFFFF0000u);
  for (int64_t p = 0; p < P; ++p) {
    _mm_prefetch((const char*)(w + 2 * p + AHEAD), _MM_HINT_T0);
    _mm_prefetch((const char*)(w + 2 * p + 1 + AHEAD), _MM_HINT_T0);
    const __m512i w0 = _mm512_load_si512(w + 2 * p), w1 = _mm512_load_si512(w + 2 * p + 1);
    const __m512 w0o = _mm512_castsi512_ps(_mm512_and_si512(w0, himask));
    const __m512 w0e = _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16));
    const __m512 w1o = _mm512_castsi512_ps(_mm512_and_si512(w1, himask));
    const __m512 w1e = _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16));
    for (int m = 0; m < ROWS; ++m) {
      const __m512 xo = _mm512_set1_ps(xf[(m * P + p) * 2]);
      const __m512 xe = _mm512_set1_ps(xf[(m * P + p) * 2 + 1]);
      lo[m] = _mm512_fmadd_ps(xo, w0o, lo[m]);
      hi[m] = _mm512_fmadd_ps(xo, w1o, hi[m]);
      lo[m] = _mm512_fmadd_ps(xe, w0e, lo[m]);
      hi[m] = _mm512_fmadd_ps(xe, w1e, hi[m]);
    }
  }
  for (int m = 0; m < ROWS; ++m) { _mm512_storeu_ps(acc + m * GROUP, lo[m]); _mm512_storeu_ps(acc + m * GROUP + 16, hi[m]); }
}
template<int ROWS> void run(int64_t G, int64_t P, int reps){
  std::mt19937 rng(1); std::normal_distribution<float> nd(0,1);
  std::vector<uint16_t> W(G*P*2*GROUP), X(ROWS*P*2);
  auto bf=[&](float f){uint32_t u; memcpy(&u,&f,4); return (uint16_t)(u>>16);};
  for(auto& v:W) v=bf(nd(rng)*0.05f); for(auto& v:X) v=bf(nd(rng));
  // some denormals
  W[5]=1; X[3]=0x0001; W[100]=0x8001;
  uint16_t* Wa=(uint16_t*)aligned_alloc(64, W.size()*2); memcpy(Wa,W.data(),W.size()*2);
  std::vector<float> xf(ROWS*P*2);
  for(int m=0;m<ROWS;m++) for(int64_t p=0;p<P;p++){ uint32_t o=(uint32_t)X[m*P*2+2*p+1]<<16, e=(uint32_t)X[m*P*2+2*p]<<16; memcpy(&xf[(m*P+p)*2],&o,4); memcpy(&xf[(m*P+p)*2+1],&e,4);}
  std::vector<float> a1(G*ROWS*GROUP), a2(G*ROWS*GROUP);
  unsigned csr=_mm_getcsr();
  for(int variant=0; variant<2; variant++){
    double best=1e9;
    for(int r=0;r<reps;r++){
      double t=now();
      #pragma omp parallel
      {
        unsigned old=_mm_getcsr(); if(variant) _mm_setcsr(old|0x8040);
        #pragma omp for schedule(static)
        for(int64_t g=0; g<G; g++){
          if(variant==0) tile_dp<ROWS>((const int32_t*)X.data(), P, (const __m512bh*)(Wa+g*P*2*GROUP), a1.data()+g*ROWS*GROUP);
          else tile_fma<ROWS>(xf.data(), P, (const __m512i*)(Wa+g*P*2*GROUP), a2.data()+g*ROWS*GROUP);
        }
        _mm_setcsr(old);
      }
      t=now()-t; if(t<best) best=t;
    }
    printf("ROWS=%2d G=%lld P=%lld %s: %.1f GFLOP/s\n", ROWS,(long long)G,(long long)P, variant?"fma ":"dpbf", 2.0*ROWS*G*GROUP*P*2/best/1e9);
  }
  printf("  bitwise equal: %d\n", memcmp(a1.data(),a2.data(),a1.size()*4)==0);
}
int main(){
  run<4>(16,768,200); run<8>(16,768,200); run<12>(16,768,200);
  run<12>(280,768,20); run<4>(280,768,20);
}

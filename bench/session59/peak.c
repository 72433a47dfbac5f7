#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(){
  __m512 acc[16]; for(int i=0;i<16;i++) acc[i]=_mm512_setzero_ps();
  __m512bh a=(__m512bh)_mm512_set1_epi32(0x3f803f80), b=(__m512bh)_mm512_set1_epi32(0x3f803f80);
  long N=200000000/16;
  double t=now();
  for(long i=0;i<N;i++){
    #pragma GCC unroll 16
    for(int j=0;j<16;j++) acc[j]=_mm512_dpbf16_ps(acc[j],a,b);
    __asm__ volatile("" : "+v"(a));
  }
  t=now()-t;
  float s=0; for(int i=0;i<16;i++){float tmp[16];_mm512_storeu_ps(tmp,acc[i]);s+=tmp[0];}
  double ops=(double)N*16;
  printf("dpbf16ps/s %.3g  -> %.3g per ns; GFLOP/s %.1f  (sum %g)\n", ops/t, ops/t/1e9, ops*64/t/1e9, s);
  // fp32 fma for comparison
  __m512 f[16]; for(int i=0;i<16;i++) f[i]=_mm512_setzero_ps(); __m512 x=_mm512_set1_ps(1e-9f);
  t=now();
  for(long i=0;i<N;i++){
    #pragma GCC unroll 16
    for(int j=0;j<16;j++) f[j]=_mm512_fmadd_ps(x,x,f[j]);
    __asm__ volatile("" : "+v"(x));
  }
  t=now()-t; s=0; for(int i=0;i<16;i++){float tmp[16];_mm512_storeu_ps(tmp,f[i]);s+=tmp[0];}
  printf("fma512/s %.3g per ns; GFLOP/s %.1f (sum %g)\n", ops/t/1e9, ops*32/t/1e9, s);
}

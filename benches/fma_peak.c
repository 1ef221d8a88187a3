/* The peak f32 multiply-add rate of one core, for judging GEMM efficiency.
 *
 *   gcc -O2 -march=native benches/fma_peak.c -o target/fma_peak && target/fma_peak
 *
 * Twelve independent chains of 256-bit FMAs (enough to cover FMA latency x throughput on
 * current x86 cores) and the same with 512-bit FMAs where the compiler targets AVX-512; one
 * dependent chain gives the clock, assuming the 4-cycle FMA latency of Zen 4 and Skylake-X
 * and later. Prints one JSON line: {"fma_gmacs_256": .., "fma_gmacs_512": .., "ghz_est": ..}.
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define CHAINS 12
#define ITERS 40000000L

/* Best of 3 timings of CHAINS independent FMA chains on vectors of LANES floats. */
#define DEFINE_RATE(NAME, VEC, LANES, SET1, FMADD, ADD, STOREU)                                  \
  static double NAME(float *sink) {                                                             \
    VEC a[CHAINS], b = SET1(1.0000001f), c = SET1(1e-7f);                                       \
    for (int i = 0; i < CHAINS; i++) a[i] = SET1((float)i);                                     \
    double best = 0;                                                                            \
    for (int rep = 0; rep < 3; rep++) {                                                         \
      double t0 = now();                                                                        \
      for (long k = 0; k < ITERS / CHAINS; k++) {                                               \
        _Pragma("GCC unroll 12") for (int i = 0; i < CHAINS; i++) a[i] = FMADD(a[i], b, c);     \
      }                                                                                         \
      double r = (double)(ITERS / CHAINS) * CHAINS * LANES / (now() - t0) / 1e9;                \
      if (r > best) best = r;                                                                   \
    }                                                                                           \
    VEC s = a[0];                                                                               \
    for (int i = 1; i < CHAINS; i++) s = ADD(s, a[i]);                                          \
    float out[LANES];                                                                           \
    STOREU(out, s);                                                                             \
    *sink += out[0];                                                                            \
    return best;                                                                                \
  }

DEFINE_RATE(ymm_rate, __m256, 8, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_add_ps, _mm256_storeu_ps)
#ifdef __AVX512F__
DEFINE_RATE(zmm_rate, __m512, 16, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_add_ps, _mm512_storeu_ps)
#endif

static double ghz_estimate(float *sink) {
  __m256 d = _mm256_set1_ps(1.0f), b = _mm256_set1_ps(1.0000001f), c = _mm256_set1_ps(1e-7f);
  double t0 = now();
  for (long k = 0; k < ITERS; k++) d = _mm256_fmadd_ps(d, b, c);
  double per = (now() - t0) / ITERS;
  float out[8];
  _mm256_storeu_ps(out, d);
  *sink += out[0];
  return 4.0 / per / 1e9;
}

int main(void) {
  float sink = 0;
  double y = ymm_rate(&sink);
#ifdef __AVX512F__
  double z = zmm_rate(&sink);
#else
  double z = 0;
#endif
  double ghz = ghz_estimate(&sink);
  printf("{\"fma_gmacs_256\":%.1f,\"fma_gmacs_512\":%.1f,\"ghz_est\":%.2f,\"sink\":%g}\n", y, z, ghz,
         (double)(sink != sink));
  return 0;
}

// The few-row dense product's inner tile (cpu_dense.cpp's bf16_gemv / f32_gemv), for every source
// that must reproduce its results bit for bit (cpu_screen.cpp recomputes some of its outputs).
// Each output element is one fp32 accumulator of 16 lanes over K in order, reduced once: the
// same bits whatever tile (R, MR) computes it.
#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

namespace qs_gemv {

#define QS_GEMV __attribute__((target("avx512f,avx512bw,avx512bf16")))
// The element types of the few-row products: kStep elements per 512-bit register, loads (masked
// past K), and the multiply-accumulate into 16 fp32 lanes (bf16: exact products, vdpbf16ps).
struct F32Lanes {
  using T = float;
  using V = __m512;
  static constexpr int kStep = 16;
  QS_GEMV static V load(const T* p) { return _mm512_loadu_ps(p); }
  QS_GEMV static V load_tail(const T* p, int64_t n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
  }
  QS_GEMV static __m512 fma(__m512 acc, V x, V w) { return _mm512_fmadd_ps(x, w, acc); }
};

struct Bf16Lanes {
  using T = uint16_t;
  using V = __m512i;
  static constexpr int kStep = 32;
  QS_GEMV static V load(const T* p) { return _mm512_loadu_si512(p); }
  QS_GEMV static V load_tail(const T* p, int64_t n) {
    return _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1), p);
  }
  QS_GEMV static __m512 fma(__m512 acc, V x, V w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
  }
};

// y[m, r] = x[m, :] . w[r, :] for R rows of w and MR rows of x, in fp32, rounded once to Out.
template <class L, int R, int MR, typename Out>
QS_GEMV void gemv_tile(const typename L::T* x, const typename L::T* w, int64_t K, Out* y,
                       int64_t ldy) {
  __m512 acc[MR][R];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + L::kStep <= K; k += L::kStep) {
    typename L::V wv[R];
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (R + r) * K + k), _MM_HINT_T0);
      wv[r] = L::load(w + r * K + k);
    }
    for (int m = 0; m < MR; ++m) {
      const typename L::V xv = L::load(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = L::fma(acc[m][r], xv, wv[r]);
    }
  }
  if (k < K) {
    typename L::V wv[R];
    for (int r = 0; r < R; ++r) wv[r] = L::load_tail(w + r * K + k, K - k);
    for (int m = 0; m < MR; ++m) {
      const typename L::V xv = L::load_tail(x + m * K + k, K - k);
      for (int r = 0; r < R; ++r) acc[m][r] = L::fma(acc[m][r], xv, wv[r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) y[m * ldy + r] = static_cast<Out>(_mm512_reduce_add_ps(acc[m][r]));
}

}  // namespace qs_gemv

#endif

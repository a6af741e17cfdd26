// Quantized-weight matmul for the CPU backend: int8 activations (quantized per block on the
// fly) times 4-bit or 8-bit weight codes, integer dot products, fp32 accumulation.
//
// Layout (built once by quantspec/kernels/cpu.py, see its docstring):
//   K is permuted (act-order) and padded to Kp = G * L: group g holds columns [g*L, (g+1)*L).
//   Activations are quantized per block of B columns (B divides L; B is 32 or a multiple of 64).
//   w4:    uint8 [N, Kp/2]. 64-column chunk c lives in bytes [32c, 32c+32): byte j holds column
//          64c+j in its low nibble and column 64c+32+j in its high nibble. Codes in [0, 15].
//   w8:    int8  [N, Kp], code - 128.
//   scales fp16  [N, G]; zeros int8 [N, G] (z for 4-bit, z - 128 for 8-bit).
//   y[m, n] = sum_b sw[n,g(b)] * sx[m,b] * dot_b(q, xq) - sum_g sw[n,g] * z[n,g] * X[m,g],
//   X[m, g] = sum_{b in g} sx[m,b] * sum(xq[m, b]).
// AVX2 (maddubs/madd, the int8 dot used by llama.cpp's Q4_0 x Q8_0) is chosen at run time when
// the CPU has it; a portable scalar path serves every other CPU. CPUs with AVX-512 VNNI get the
// panel layout instead (qgemm_panel, below).

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include "cpu_qgemm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <immintrin.h>
#define QS_X86 1
#endif
#if defined(QS_X86) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using qs_cpu::Acts;
using qs_cpu::Geometry;

// One block of activations -> int8 codes (absmax / 127, round half to even, as
// quantspec.kernels.reference.quantize_per_token_int8 does); returns the sum of the codes.
int32_t quantize_block_scalar(const float* v, int64_t n, int8_t* q, float* scale_out) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float scale = std::max(amax / 127.0f, 1e-10f);
  int32_t sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float r = std::nearbyint(v[i] / scale);
    const int32_t c = static_cast<int32_t>(std::min(127.f, std::max(-127.f, r)));
    q[i] = static_cast<int8_t>(c);
    sum += c;
  }
  *scale_out = scale;
  return sum;
}

#if defined(__x86_64__) || defined(_M_X64)
// Same result as quantize_block_scalar for n % 32 == 0 (cvtps rounds half to even).
__attribute__((target("avx2,fma"))) int32_t quantize_block_avx2(const float* v, int64_t n,
                                                               int8_t* q, float* scale_out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 vmax = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8)
    vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + i)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float scale = std::max(_mm_cvtss_f32(m4) / 127.0f, 1e-10f);
  const __m256 vs = _mm256_set1_ps(scale);
  const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
  __m256i vsum = _mm256_setzero_si256();
  for (int64_t i = 0; i < n; i += 32) {
    __m256i c[4];
    for (int j = 0; j < 4; ++j) {
      c[j] = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(v + i + 8 * j), vs));
      c[j] = _mm256_max_epi32(_mm256_min_epi32(c[j], lim), nlim);
      vsum = _mm256_add_epi32(vsum, c[j]);
    }
    // pack 4x8 int32 -> 32 int8 in order (packs work per 128-bit lane, then fix the order)
    const __m256i p01 = _mm256_packs_epi32(c[0], c[1]);
    const __m256i p23 = _mm256_packs_epi32(c[2], c[3]);
    const __m256i p = _mm256_packs_epi16(p01, p23);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm256_permutevar8x32_epi32(p, order));
  }
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(vsum), _mm256_extracti128_si256(vsum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  *scale_out = scale;
  return _mm_cvtsi128_si32(s4);
}
#endif

// x (float [M, K]) -> int8 codes per block of B, the block scales, and the per-group sums X.
// src (int32 [Kp], or null for identity) gathers columns; a column >= K reads as zero.
void quantize_activations(const float* x, const int32_t* src, const Geometry& g, bool simd,
                          int8_t* xq, float* sx, float* xg) {
  const int64_t nblk = g.nblk(), bpg = g.bpg();
  // rows are independent: in parallel from a few rows on (one row costs ~2 us per 4096 columns)
  at::parallel_for(0, g.M, 2, [&](int64_t m0, int64_t m1) {
    std::vector<float> buf(g.B);
    for (int64_t m = m0; m < m1; ++m) {
      const float* xm = x + m * g.K;
      for (int64_t gi = 0; gi < g.G; ++gi) xg[m * g.G + gi] = 0.f;
      for (int64_t b = 0; b < nblk; ++b) {
        const int64_t k0 = b * g.B;
        const float* v = xm + k0;
        if (src || k0 + g.B > g.K) {
          for (int64_t i = 0; i < g.B; ++i) {
            const int64_t s = src ? src[k0 + i] : k0 + i;
            buf[i] = s < g.K ? xm[s] : 0.f;
          }
          v = buf.data();
        }
        float scale;
        int8_t* q = xq + m * g.xld() + k0;
        int32_t sum;
#if defined(__x86_64__) || defined(_M_X64)
        if (simd) sum = quantize_block_avx2(v, g.B, q, &scale);
        else
#endif
          sum = quantize_block_scalar(v, g.B, q, &scale);
        sx[m * nblk + b] = scale;
        xg[m * g.G + b / bpg] += scale * static_cast<float>(sum);
      }
    }
  });
}

// One output row n: fp16 scales and int8 zeros -> fp32 scales and scale * zero.
void row_scales(const c10::Half* sw, const int8_t* z, int64_t G, float* swf, float* szf) {
  for (int64_t gi = 0; gi < G; ++gi) {
    swf[gi] = static_cast<float>(sw[gi]);
    szf[gi] = swf[gi] * static_cast<float>(z[gi]);
  }
}

float zero_correction(const float* szf, const float* xg, int64_t G) {
  float c = 0.f;
  for (int64_t gi = 0; gi < G; ++gi) c += szf[gi] * xg[gi];
  return c;
}

// ---- portable path ----------------------------------------------------------------------

template <int BITS>
inline int32_t code_at(const uint8_t* w, int64_t k) {
  if (BITS == 8) return static_cast<int8_t>(w[k]);
  const int64_t c = k / 64, j = k % 64;
  const uint8_t byte = w[32 * c + (j % 32)];
  return j < 32 ? (byte & 0x0F) : (byte >> 4);
}

// Not auto-vectorized: GCC 12 turns this signed x signed-from-unsigned sum into vpdpbusd when
// AVX-512 VNNI is on (-march=native) and loses the sign of the 8-bit codes (observed: code -8
// read as 248). The fallback must stay exact; the SIMD paths are written by hand.
#if defined(__GNUC__) && !defined(__clang__)
#define QS_NO_VECTORIZE __attribute__((optimize("no-tree-vectorize")))
#else
#define QS_NO_VECTORIZE
#endif

template <int BITS>
QS_NO_VECTORIZE void row_scalar(const uint8_t* w, const float* swf, const float* szf, const Acts& a,
                const Geometry& g, int64_t m0, int64_t mt, float* y) {
  const int64_t nblk = g.nblk(), bpg = g.bpg();
  for (int64_t m = m0; m < m0 + mt; ++m) {
    const int8_t* xm = a.xq + m * g.xld();
    float acc = 0.f;
    for (int64_t b = 0; b < nblk; ++b) {
      int32_t isum = 0;
      for (int64_t i = b * g.B; i < (b + 1) * g.B; ++i) isum += code_at<BITS>(w, i) * xm[i];
      acc += swf[b / bpg] * a.sx[m * nblk + b] * static_cast<float>(isum);
    }
    y[m * g.N] = acc - zero_correction(szf, a.xg + m * g.G, g.G);
  }
}

// ---- AVX2 path --------------------------------------------------------------------------
#ifdef QS_X86
#define QS_AVX2 __attribute__((target("avx2,fma")))

QS_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

QS_AVX2 float zero_correction_avx2(const float* szf, const float* xg, int64_t G) {
  __m256 acc = _mm256_setzero_ps();
  int64_t gi = 0;
  for (; gi + 8 <= G; gi += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(szf + gi), _mm256_loadu_ps(xg + gi), acc);
  float c = hsum(acc);
  for (; gi < G; ++gi) c += szf[gi] * xg[gi];
  return c;
}

__attribute__((target("avx2,fma,f16c"))) void row_scales_f16c(const c10::Half* sw,
                                                              const int8_t* z, int64_t G,
                                                              float* swf, float* szf) {
  int64_t gi = 0;
  for (; gi + 8 <= G; gi += 8) {
    const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sw + gi)));
    const __m128i z8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(z + gi));
    const __m256 zf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(z8));
    _mm256_storeu_ps(swf + gi, s);
    _mm256_storeu_ps(szf + gi, _mm256_mul_ps(s, zf));
  }
  row_scales(sw + gi, z + gi, G - gi, swf + gi, szf + gi);
}

QS_AVX2 inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}

// 4-bit codes, MT activation rows at once (weights unpacked once per chunk).
template <int MT>
QS_AVX2 void row4_avx2(const uint8_t* w, const float* swf, const float* szf, const Acts& a,
                       const Geometry& g, int64_t m0, float* y) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t nblk = g.nblk(), bpg = g.bpg();
  const int8_t* x[MT];
  const float* sx[MT];
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) {
    x[m] = a.xq + (m0 + m) * g.xld();
    sx[m] = a.sx + (m0 + m) * nblk;
    acc[m] = _mm256_setzero_ps();
  }
  int64_t gi = 0, in_group = 0;  // group of the current block
  if (g.B == 32) {  // each chunk is two blocks: low nibbles block 2c, high nibbles block 2c+1
    for (int64_t c = 0; c < g.Kp / 64; ++c) {
      const __m256i v = load32(w + 32 * c);
      const __m256i lo = _mm256_and_si256(v, mask);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
      const __m256 s0 = _mm256_set1_ps(swf[gi]);
      if (++in_group == bpg) in_group = 0, ++gi;
      const __m256 s1 = _mm256_set1_ps(swf[gi]);
      if (++in_group == bpg) in_group = 0, ++gi;
      for (int m = 0; m < MT; ++m) {
        const __m256i d0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load32(x[m] + 64 * c)), ones);
        const __m256i d1 =
            _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load32(x[m] + 64 * c + 32)), ones);
        const __m256 f0 = _mm256_mul_ps(_mm256_cvtepi32_ps(d0), _mm256_set1_ps(sx[m][2 * c]));
        const __m256 f1 = _mm256_mul_ps(_mm256_cvtepi32_ps(d1), _mm256_set1_ps(sx[m][2 * c + 1]));
        acc[m] = _mm256_fmadd_ps(f0, s0, acc[m]);
        acc[m] = _mm256_fmadd_ps(f1, s1, acc[m]);
      }
    }
  } else {
    const int64_t cpb = g.B / 64;
    for (int64_t b = 0; b < nblk; ++b) {
      __m256i isum[MT];
      for (int m = 0; m < MT; ++m) isum[m] = _mm256_setzero_si256();
      // two chunks per step: 4 products of at most 2*15*127 each stay inside int16
      const int64_t c_end = (b + 1) * cpb;
      int64_t c = b * cpb;
      for (; c + 2 <= c_end; c += 2) {
        const __m256i v0 = load32(w + 32 * c), v1 = load32(w + 32 * c + 32);
        const __m256i lo0 = _mm256_and_si256(v0, mask);
        const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), mask);
        const __m256i lo1 = _mm256_and_si256(v1, mask);
        const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), mask);
        for (int m = 0; m < MT; ++m) {
          const int8_t* xc = x[m] + 64 * c;
          const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, load32(xc)),
                                              _mm256_maddubs_epi16(hi0, load32(xc + 32)));
          const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo1, load32(xc + 64)),
                                              _mm256_maddubs_epi16(hi1, load32(xc + 96)));
          isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones));
        }
      }
      if (c < c_end) {  // an odd chunk (B = 64, 192, ...)
        const __m256i v = load32(w + 32 * c);
        const __m256i lo = _mm256_and_si256(v, mask);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        for (int m = 0; m < MT; ++m) {
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, load32(x[m] + 64 * c)),
                                             _mm256_maddubs_epi16(hi, load32(x[m] + 64 * c + 32)));
          isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(p, ones));
        }
      }
      const __m256 s = _mm256_set1_ps(swf[gi]);
      for (int m = 0; m < MT; ++m) {
        const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(isum[m]), _mm256_set1_ps(sx[m][b]));
        acc[m] = _mm256_fmadd_ps(f, s, acc[m]);
      }
      if (++in_group == bpg) in_group = 0, ++gi;
    }
  }
  for (int m = 0; m < MT; ++m)
    y[(m0 + m) * g.N] = hsum(acc[m]) - zero_correction_avx2(szf, a.xg + (m0 + m) * g.G, g.G);
}

// 8-bit signed codes: |w| * sign(x, w) keeps maddubs' unsigned x signed operands exact.
template <int MT>
QS_AVX2 void row8_avx2(const uint8_t* w, const float* swf, const float* szf, const Acts& a,
                       const Geometry& g, int64_t m0, float* y) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t nblk = g.nblk(), bpg = g.bpg(), spb = g.B / 32;
  const int8_t* x[MT];
  const float* sx[MT];
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) {
    x[m] = a.xq + (m0 + m) * g.xld();
    sx[m] = a.sx + (m0 + m) * nblk;
    acc[m] = _mm256_setzero_ps();
  }
  int64_t gi = 0, in_group = 0;
  for (int64_t b = 0; b < nblk; ++b) {
    __m256i isum[MT];
    for (int m = 0; m < MT; ++m) isum[m] = _mm256_setzero_si256();
    for (int64_t s = b * spb; s < (b + 1) * spb; ++s) {
      const __m256i v = load32(w + 32 * s);
      const __m256i av = _mm256_abs_epi8(v);
      for (int m = 0; m < MT; ++m) {
        const __m256i xs = _mm256_sign_epi8(load32(x[m] + 32 * s), v);
        isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(_mm256_maddubs_epi16(av, xs), ones));
      }
    }
    const __m256 sc = _mm256_set1_ps(swf[gi]);
    for (int m = 0; m < MT; ++m) {
      const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(isum[m]), _mm256_set1_ps(sx[m][b]));
      acc[m] = _mm256_fmadd_ps(f, sc, acc[m]);
    }
    if (++in_group == bpg) in_group = 0, ++gi;
  }
  for (int m = 0; m < MT; ++m)
    y[(m0 + m) * g.N] = hsum(acc[m]) - zero_correction_avx2(szf, a.xg + (m0 + m) * g.G, g.G);
}

template <int BITS, int MT>
QS_AVX2 void row_avx2(const uint8_t* w, const float* swf, const float* szf, const Acts& a,
                      const Geometry& g, int64_t m0, float* y) {
  if (BITS == 4) row4_avx2<MT>(w, swf, szf, a, g, m0, y);
  else row8_avx2<MT>(w, swf, szf, a, g, m0, y);
}

bool cpu_has_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
}

// ---- AVX-512 VNNI (vpdpbusd: u8 x s8 -> s32, 64 products per instruction): panel layout ----
#define QS_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

// Weight bytes read ahead of use (and 4x as far into L2): panels are streamed once, in order.
#ifndef QS_PREFETCH
#define QS_PREFETCH 4096
#endif

QS_VNNI inline __m512i load64(const void* p) { return _mm512_loadu_si512(p); }

bool cpu_has_vnni() {
  static const bool ok = cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
  return ok;
}
#endif

// One output row n against every activation row, tiled 4 rows at a time.
template <int BITS>
void row_all_m(const uint8_t* w, const float* swf, const float* szf, const Acts& a,
               const Geometry& g, bool simd, float* y) {
  int64_t m0 = 0;
#ifdef QS_X86
  if (simd) {
    for (; m0 + 4 <= g.M; m0 += 4) row_avx2<BITS, 4>(w, swf, szf, a, g, m0, y);
    switch (g.M - m0) {
      case 3: row_avx2<BITS, 3>(w, swf, szf, a, g, m0, y); break;
      case 2: row_avx2<BITS, 2>(w, swf, szf, a, g, m0, y); break;
      case 1: row_avx2<BITS, 1>(w, swf, szf, a, g, m0, y); break;
      default: break;
    }
    return;
  }
#endif
  row_scalar<BITS>(w, swf, szf, a, g, 0, g.M, y);
}

// ---- Panel layout (AVX-512 VNNI CPUs): 16 output rows per panel, dot products per lane ----
// Built by quantspec/kernels/cpu.py (prepare_ext(..., layout="panels")); N padded to Np = 16P.
//   w4:    uint8 [P, Kp/8, 64]: in octet j of panel p, byte 4i+t holds row 16p+i's column 8j+t
//          in its low nibble and column 8j+4+t in its high nibble.
//   w8:    uint8 [P, Kp/4, 64]: in quad j, byte 4i+t is row 16p+i's code (unsigned) of column 4j+t.
//   scales fp16 [P, G, 16]; zeros uint8 [P, G, 16] (z as is, for 4 and 8 bits).
// One vpdpbusd multiplies 16 rows' 4 codes by the same 4 activation bytes (a broadcast), so
// each lane is one output: the block's float scaling is one multiply per 16 outputs.
#ifdef QS_X86
// The end of a panel: rows [mt, 16] (its outputs for x rows m0..) minus the zero points'
// sum_g s[g] z[g] X[m, g], stored into the first `valid` outputs of y's rows from n0.
QS_VNNI void panel_finish(const c10::Half* sc, const uint8_t* zr, const Acts& a, const Geometry& g,
                          int64_t m0, int mt, int64_t n0, int64_t valid, float* rows, float* y) {
  for (int64_t gq = 0; gq < g.G; ++gq) {
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 16 * gq)));
    const __m128i z8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(zr + 16 * gq));
    const __m512 sz = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(z8)));
    for (int m = 0; m < mt; ++m)
      _mm512_store_ps(rows + 16 * m, _mm512_fnmadd_ps(sz, _mm512_set1_ps(a.xg[(m0 + m) * g.G + gq]),
                                                     _mm512_load_ps(rows + 16 * m)));
  }
  const __mmask16 keep = valid >= 16 ? static_cast<__mmask16>(0xFFFF)
                                     : static_cast<__mmask16>((1u << valid) - 1u);
  for (int m = 0; m < mt; ++m)
    _mm512_mask_storeu_ps(y + (m0 + m) * g.N + n0, keep, _mm512_load_ps(rows + 16 * m));
}

template <int BITS, int MT>
QS_VNNI void panel_vnni(const uint8_t* w, const c10::Half* sc, const uint8_t* zr, const Acts& a,
                        const Geometry& g, int64_t m0, int64_t n0, int64_t valid, float* y) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  const int64_t nblk = g.nblk(), bpg = g.bpg();
  const int64_t cols_per_step = BITS == 4 ? 8 : 4, steps_per_block = g.B / cols_per_step;
  const int8_t* x[MT];
  const float* sx[MT];
  __m512 acc[MT];
  __m512i isum[MT];
  for (int m = 0; m < MT; ++m) {
    x[m] = a.xq + (m0 + m) * g.xld();
    sx[m] = a.sx + (m0 + m) * nblk;
    acc[m] = _mm512_setzero_ps();
  }
  // With few rows, one accumulator per row is a chain of dependent vpdpbusd (5 cycles each):
  // rows of x up to 4 get a second, independent accumulator (4-bit: the high nibbles, used in
  // place as 16 x code, one instruction fewer per 64 bytes; 8-bit: odd steps), added at the end
  // of each block.
  constexpr bool SPLIT = MT <= 4;
  __m512i isum2[MT];
  int64_t gi = 0, in_group = 0, j = 0;
  __m512 ws = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
  for (int64_t b = 0; b < nblk; ++b) {
    for (int m = 0; m < MT; ++m) isum[m] = isum2[m] = _mm512_setzero_si512();
    for (const int64_t j_end = j + steps_per_block; j < j_end; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(w + 64 * j + QS_PREFETCH), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + 64 * j + 4 * QS_PREFETCH), _MM_HINT_T1);
      const __m512i v = load64(w + 64 * j);
      if (BITS == 4 && SPLIT) {  // high nibbles in place (16 x code): isum2 is 16x, shifted below
        const __m512i lo = _mm512_and_si512(v, mask);
        const __m512i hi16 = _mm512_andnot_si512(mask, v);
        for (int m = 0; m < MT; ++m) {
          const int32_t* xj = reinterpret_cast<const int32_t*>(x[m] + 8 * j);
          isum[m] = _mm512_dpbusd_epi32(isum[m], lo, _mm512_set1_epi32(xj[0]));
          isum2[m] = _mm512_dpbusd_epi32(isum2[m], hi16, _mm512_set1_epi32(xj[1]));
        }
      } else if (BITS == 4) {
        const __m512i lo = _mm512_and_si512(v, mask);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
        for (int m = 0; m < MT; ++m) {
          const int32_t* xj = reinterpret_cast<const int32_t*>(x[m] + 8 * j);
          isum[m] = _mm512_dpbusd_epi32(isum[m], lo, _mm512_set1_epi32(xj[0]));
          isum[m] = _mm512_dpbusd_epi32(isum[m], hi, _mm512_set1_epi32(xj[1]));
        }
      } else {
        for (int m = 0; m < MT; ++m) {
          const int32_t* xj = reinterpret_cast<const int32_t*>(x[m] + 4 * j);
          __m512i& into = (SPLIT && (j & 1)) ? isum2[m] : isum[m];
          into = _mm512_dpbusd_epi32(into, v, _mm512_set1_epi32(xj[0]));
        }
      }
    }
    if (SPLIT)  // 4-bit: isum2 holds 16 x the high nibbles' sums (exact: a multiple of 16)
      for (int m = 0; m < MT; ++m)
        isum[m] = _mm512_add_epi32(isum[m], BITS == 4 ? _mm512_srai_epi32(isum2[m], 4) : isum2[m]);
    for (int m = 0; m < MT; ++m)
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]),
                               _mm512_mul_ps(ws, _mm512_set1_ps(sx[m][b])), acc[m]);
    if (++in_group == bpg && b + 1 < nblk) {
      in_group = 0, ++gi;
      ws = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 16 * gi)));
    }
  }
  alignas(64) float rows[MT * 16];
  for (int m = 0; m < MT; ++m) _mm512_store_ps(rows + 16 * m, acc[m]);
  panel_finish(sc, zr, a, g, m0, MT, n0, valid, rows, y);
}

template <int BITS>
QS_VNNI void panel_all_m(const uint8_t* w, const c10::Half* sc, const uint8_t* zr, const Acts& a,
                         const Geometry& g, int64_t n0, int64_t valid, float* y) {
  int64_t m0 = 0;
  for (; m0 + 8 <= g.M; m0 += 8) panel_vnni<BITS, 8>(w, sc, zr, a, g, m0, n0, valid, y);
  switch (g.M - m0) {
    case 7: panel_vnni<BITS, 7>(w, sc, zr, a, g, m0, n0, valid, y); break;
    case 6: panel_vnni<BITS, 6>(w, sc, zr, a, g, m0, n0, valid, y); break;
    case 5: panel_vnni<BITS, 5>(w, sc, zr, a, g, m0, n0, valid, y); break;
    case 4: panel_vnni<BITS, 4>(w, sc, zr, a, g, m0, n0, valid, y); break;
    case 3: panel_vnni<BITS, 3>(w, sc, zr, a, g, m0, n0, valid, y); break;
    case 2: panel_vnni<BITS, 2>(w, sc, zr, a, g, m0, n0, valid, y); break;
    case 1: panel_vnni<BITS, 1>(w, sc, zr, a, g, m0, n0, valid, y); break;
    default: break;
  }
}

// ---- AMX (Intel Sapphire Rapids and later): the same panels through int8 tile products ----
// For several rows of x the VNNI loop is bound by vpdpbusd (2 per 64 weight bytes per row);
// one tdpbsud multiplies x rows [mt, kc] (signed) by a panel's [kc, 16] codes (unsigned) into
// [mt, 16] int32 sums, the exact block sums the VNNI loop forms, so the results are identical.
// The panel layout is already the tile's B operand: row r of B holds 16 outputs x 4 columns
// (4-bit: an octet's low nibbles are quad 2j, its high nibbles quad 2j + 1; 8-bit: quad j).
#define QS_AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#ifndef QS_AMX_MIN_M
#define QS_AMX_MIN_M 8
#endif

bool cpu_has_amx() {
  static const bool ok = [] {
    unsigned eax, ebx, ecx, edx;
    if (!cpu_has_vnni() || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if (!((edx >> 24) & 1u) || !((edx >> 25) & 1u)) return false;  // AMX-TILE, AMX-INT8
#if defined(__linux__)
    // Linux hands out the tile data state on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
    return false;
#endif
  }();
  return ok;
}

// GCC 12's _tile_loadd and _tile_loadconfig tell the compiler they read no memory (tileloadd)
// or 8 bytes (ldtilecfg), so the stores that fill their sources may be dropped or moved past
// them: these two say what they read.
#define QS_TILE_LOAD(t, base, stride)                                                \
  __asm__ volatile("{tileloadd\t(%0,%1,1), %%tmm" #t "|tileloadd\t%%tmm" #t ", [%0+%1*1]}" \
                   ::"r"(static_cast<const void*>(base)), "r"(static_cast<long>(stride))   \
                   : "memory")
#define QS_TILE_CONFIG(cfg) \
  __asm__ volatile("ldtilecfg\t%X0" ::"m"(*reinterpret_cast<const unsigned char(*)[64]>(cfg)))

// Palette 1: tile 0 = A (x rows [mt, kc] int8), tiles 1-3 = C (three panels' [mt, 16] int32
// sums), tiles 4-6 = B (the three panels' [kc / 4, 16 x 4] codes). Three panels at a time share
// each load of x and keep three independent tile products in flight.
QS_AMX void configure_tiles(int64_t mt, int64_t kc) {
  // palette 1: byte 0 palette, bytes 16 + 2t colsb of tile t (uint16), byte 48 + t its rows
  alignas(64) unsigned char cfg[64] = {};
  auto tile = [&](int t, int64_t rows, int64_t colsb) {
    cfg[16 + 2 * t] = static_cast<unsigned char>(colsb);  // colsb: uint16 little-endian, <= 64
    cfg[48 + t] = static_cast<unsigned char>(rows);
  };
  cfg[0] = 1;
  tile(0, mt, kc);
  for (int q = 0; q < 3; ++q) tile(1 + q, mt, 64), tile(4 + q, kc / 4, 64);
  QS_TILE_CONFIG(cfg);
}

// The tile intrinsics take literal tile numbers: panel Q's C and B tiles, picked at compile time.
template <int Q> QS_AMX inline void tile_zero_c() {
  if constexpr (Q == 0) _tile_zero(1); else if constexpr (Q == 1) _tile_zero(2); else _tile_zero(3);
}
template <int Q> QS_AMX inline void tile_load_b(const void* p) {
  if constexpr (Q == 0) QS_TILE_LOAD(4, p, 64);
  else if constexpr (Q == 1) QS_TILE_LOAD(5, p, 64);
  else QS_TILE_LOAD(6, p, 64);
}
template <int Q> QS_AMX inline void tile_dot() {  // C_Q += A . B_Q (signed x, unsigned codes)
  if constexpr (Q == 0) _tile_dpbsud(1, 0, 4);
  else if constexpr (Q == 1) _tile_dpbsud(2, 0, 5);
  else _tile_dpbsud(3, 0, 6);
}
template <int Q> QS_AMX inline void tile_store_c(void* p) {
  if constexpr (Q == 0) _tile_stored(1, p, 64);
  else if constexpr (Q == 1) _tile_stored(2, p, 64);
  else _tile_stored(3, p, 64);
}

// One chunk of a panel (lines of 64 weight bytes from wl) prefetched ahead and, for 4 bits,
// its octets' low and high nibbles unpacked into bt: the rows of the chunk's B tile.
template <int BITS>
QS_AMX inline void stage_chunk(const uint8_t* wl, int64_t lines, uint8_t* bt) {
  for (int64_t l = 0; l < lines; ++l) {
    _mm_prefetch(reinterpret_cast<const char*>(wl + 64 * l + QS_PREFETCH), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wl + 64 * l + 4 * QS_PREFETCH), _MM_HINT_T1);
  }
  if constexpr (BITS == 4) {
    const __m512i mask = _mm512_set1_epi8(0x0F);
    for (int64_t l = 0; l < lines; ++l) {
      const __m512i v = load64(wl + 64 * l);
      _mm512_store_si512(bt + 128 * l, _mm512_and_si512(v, mask));
      _mm512_store_si512(bt + 128 * l + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
    }
  }
}

// Panel Q's B tile (its rows at bt) times the x tile in tile 0, into C_Q.
template <int Q>
QS_AMX inline void chunk_dot(const uint8_t* bt) {
  tile_load_b<Q>(bt);
  tile_dot<Q>();
}

// Panel Q's block sums (tile C_Q) scaled into its float rows: rows[m] += C[m] * ws * sx[m, b].
template <int Q>
QS_AMX inline void block_scale(__m512 ws, const float* sx, int64_t nblk, int mt, int32_t* ct,
                               float* rows) {
  tile_store_c<Q>(ct);
  for (int m = 0; m < mt; ++m) {
    const __m512 f = _mm512_cvtepi32_ps(_mm512_load_si512(ct + 16 * m));
    const __m512 s = _mm512_mul_ps(ws, _mm512_set1_ps(sx[m * nblk]));
    _mm512_store_ps(rows + 16 * m, _mm512_fmadd_ps(f, s, _mm512_load_ps(rows + 16 * m)));
  }
}

// NP (1-3) adjacent panels from panel p against every row of x, 16 rows at a time. *configured
// is the row count the tiles are set up for (0: none yet).
template <int BITS, int NP>
QS_AMX void panels_amx(const uint8_t* w, int64_t panel_bytes, const c10::Half* sc,
                       const uint8_t* zr, const Acts& a, const Geometry& g, int64_t p, int64_t kc,
                       int* configured, float* y) {
  const int64_t nblk = g.nblk(), bpg = g.bpg(), chunks = g.B / kc, ps = g.G * 16;
  const uint8_t* wp = w + p * panel_bytes;
  const c10::Half* sp = sc + p * ps;
  const int64_t lines = kc / (BITS == 4 ? 8 : 4);  // 64-byte weight lines per chunk
  const int64_t total = nblk * chunks;
  // 4-bit: chunk c + 1 is unpacked while chunk c's tiles load (a tile load right behind the
  // stores it reads would wait for them)
  alignas(64) uint8_t bt[2][NP][16 * 64];
  alignas(64) int32_t ct[16 * 16];
  alignas(64) float rows[NP][16 * 16];
  auto b_rows = [&](int64_t c, int q) -> const uint8_t* {
    return BITS == 4 ? bt[c & 1][q] : wp + q * panel_bytes + 64 * lines * c;
  };
  for (int64_t m0 = 0; m0 < g.M; m0 += 16) {
    const int mt = static_cast<int>(std::min<int64_t>(16, g.M - m0));
    if (mt != *configured) configure_tiles(mt, kc), *configured = mt;
    __m512 ws[NP];
    for (int q = 0; q < NP; ++q) {
      for (int m = 0; m < mt; ++m) _mm512_store_ps(rows[q] + 16 * m, _mm512_setzero_ps());
      ws[q] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp + q * ps)));
      stage_chunk<BITS>(wp + q * panel_bytes, lines, bt[0][q]);
    }
    const int8_t* xa = a.xq + m0 * g.xld();
    const float* sx = a.sx + m0 * nblk;
    int64_t gi = 0, in_group = 0;
    for (int64_t c = 0; c < total; ++c) {
      if (c % chunks == 0) {
        tile_zero_c<0>();
        if (NP > 1) tile_zero_c<1>();
        if (NP > 2) tile_zero_c<2>();
      }
      if (c + 1 < total)
        for (int q = 0; q < NP; ++q)
          stage_chunk<BITS>(wp + q * panel_bytes + 64 * lines * (c + 1), lines, bt[(c + 1) & 1][q]);
      QS_TILE_LOAD(0, xa + c * kc, g.xld());
      chunk_dot<0>(b_rows(c, 0));
      if (NP > 1) chunk_dot<1>(b_rows(c, NP > 1 ? 1 : 0));
      if (NP > 2) chunk_dot<2>(b_rows(c, NP > 2 ? 2 : 0));
      if ((c + 1) % chunks) continue;
      const int64_t b = c / chunks;
      block_scale<0>(ws[0], sx + b, nblk, mt, ct, rows[0]);
      if (NP > 1) block_scale<1>(ws[NP > 1 ? 1 : 0], sx + b, nblk, mt, ct, rows[NP > 1 ? 1 : 0]);
      if (NP > 2) block_scale<2>(ws[NP > 2 ? 2 : 0], sx + b, nblk, mt, ct, rows[NP > 2 ? 2 : 0]);
      if (++in_group == bpg && b + 1 < nblk) {
        in_group = 0, ++gi;
        for (int q = 0; q < NP; ++q)
          ws[q] = _mm512_cvtph_ps(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp + q * ps + 16 * gi)));
      }
    }
    for (int q = 0; q < NP; ++q)
      panel_finish(sp + q * ps, zr + (p + q) * ps, a, g, m0, mt, 16 * (p + q),
                   std::min<int64_t>(16, g.N - 16 * (p + q)), rows[q], y);
  }
}

// Panels [p0, p1) against every row of x, three panels at a time; tiles released at the end.
template <int BITS>
QS_AMX void panel_range_amx(const uint8_t* w, int64_t panel_bytes, const c10::Half* sc,
                            const uint8_t* zr, const Acts& a, const Geometry& g, int64_t p0,
                            int64_t p1, int64_t kc, float* y) {
  int configured = 0;
  for (int64_t p = p0; p < p1;) {
    const int64_t np = std::min<int64_t>(3, p1 - p);
    if (np == 3) panels_amx<BITS, 3>(w, panel_bytes, sc, zr, a, g, p, kc, &configured, y);
    else if (np == 2) panels_amx<BITS, 2>(w, panel_bytes, sc, zr, a, g, p, kc, &configured, y);
    else panels_amx<BITS, 1>(w, panel_bytes, sc, zr, a, g, p, kc, &configured, y);
    p += np;
  }
  _tile_release();
}
#endif

void check_layout(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales,
                  const torch::Tensor& zeros, int64_t bits, int64_t B) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D [M, K]");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(),
              "w must be a contiguous uint8 [N, Kp/2 or Kp] tensor");
  TORCH_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous() && scales.dim() == 2,
              "scales must be contiguous fp16 [N, G]");
  TORCH_CHECK(zeros.scalar_type() == torch::kInt8 && zeros.sizes() == scales.sizes() &&
                  zeros.is_contiguous(), "zeros must be contiguous int8 [N, G]");
  TORCH_CHECK(scales.size(0) == w.size(0), "scales and w disagree on N");
  const int64_t Kp = bits == 4 ? 2 * w.size(1) : w.size(1);
  const int64_t G = scales.size(1);
  TORCH_CHECK(G > 0 && Kp % G == 0 && (Kp / G) % B == 0, "Kp=", Kp, " is not G=", G,
              " groups of whole blocks of ", B);
  TORCH_CHECK(bits == 8 ? B % 32 == 0 : (B == 32 || B % 64 == 0), "bad block length ", B);
  TORCH_CHECK(bits == 8 || Kp % 64 == 0, "4-bit Kp must be a multiple of 64");
}

// Per-call buffers of the calling thread, reused across calls: decode runs hundreds of small
// products per token, where allocating and converting tensors costs as much as the product.
struct Scratch {
  std::vector<float> xf, sx, xg, y, bias;
  std::vector<int8_t> xq;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// t (contiguous-able, float/bf16/fp16) as floats: its own data when it is contiguous fp32.
const float* as_floats(const torch::Tensor& t, std::vector<float>& buf) {
  if (t.scalar_type() == torch::kFloat && t.is_contiguous()) return t.data_ptr<float>();
  const torch::Tensor c = t.contiguous();
  const int64_t n = c.numel();
  buf.resize(n);
  if (c.scalar_type() == torch::kBFloat16) {
    const c10::BFloat16* p = c.data_ptr<c10::BFloat16>();
    at::parallel_for(0, n, 16384, [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) buf[i] = static_cast<float>(p[i]);
    });
  } else if (c.scalar_type() == torch::kHalf) {
    const c10::Half* p = c.data_ptr<c10::Half>();
    at::parallel_for(0, n, 16384, [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) buf[i] = static_cast<float>(p[i]);
    });
  } else {
    const torch::Tensor f = c.to(torch::kFloat);
    std::copy(f.data_ptr<float>(), f.data_ptr<float>() + n, buf.begin());
  }
  return buf.data();
}

Acts quantize_acts(const torch::Tensor& x, const torch::Tensor& src, const Geometry& g, bool simd) {
  const bool has_src = src.numel() > 0;
  TORCH_CHECK(!has_src || (src.scalar_type() == torch::kInt && src.numel() == g.Kp),
              "src must be int32 [Kp]");
  TORCH_CHECK(has_src || g.K <= g.Kp, "x has more columns than the layout");
  Scratch& s = scratch();
  const float* xf = as_floats(x, s.xf);
  s.xq.resize(g.M * g.xld());
  s.sx.resize(g.M * g.nblk());
  s.xg.resize(g.M * g.G);
  quantize_activations(xf, has_src ? src.data_ptr<int32_t>() : nullptr, g, simd, s.xq.data(),
                       s.sx.data(), s.xg.data());
  return {s.xq.data(), s.sx.data(), s.xg.data()};
}

// The float products y [M, N] (+ bias [N]) as a new tensor of dtype.
torch::Tensor finish(const float* y, int64_t M, int64_t N,
                     const c10::optional<torch::Tensor>& bias, torch::ScalarType dtype) {
  const bool has_bias = bias.has_value() && bias->defined();
  const float* b = has_bias ? as_floats(*bias, scratch().bias) : nullptr;
  torch::Tensor out = torch::empty({M, N}, torch::TensorOptions().dtype(dtype));
  auto write = [&](auto* o) {
    using T = std::remove_pointer_t<decltype(o)>;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n)
        o[m * N + n] = static_cast<T>(y[m * N + n] + (b ? b[n] : 0.f));
  };
  if (dtype == torch::kBFloat16) write(out.data_ptr<c10::BFloat16>());
  else if (dtype == torch::kHalf) write(out.data_ptr<c10::Half>());
  else write(out.data_ptr<float>());
  return out;
}

}  // namespace

// ---- the kernels for other sources of the extension (cpu_qgemm.h) ----
namespace qs_cpu {

bool has_avx2() {
#ifdef QS_X86
  return cpu_has_avx2();
#else
  return false;
#endif
}

bool has_vnni() {
#ifdef QS_X86
  return cpu_has_vnni();
#else
  return false;
#endif
}

void quantize_rows(const float* x, const int32_t* src, const Geometry& g, bool simd, int8_t* xq,
                   float* sx, float* xg) {
  quantize_activations(x, src, g, simd, xq, sx, xg);
}

void rows_range(const uint8_t* w, int64_t row_bytes, const c10::Half* scales, const int8_t* zeros,
                int bits, const Acts& a, const Geometry& g, bool simd, int64_t n0, int64_t n1,
                float* y) {
  std::vector<float> swf(g.G), szf(g.G);
  for (int64_t n = n0; n < n1; ++n) {
#ifdef QS_X86
    if (simd) row_scales_f16c(scales + n * g.G, zeros + n * g.G, g.G, swf.data(), szf.data());
    else
#endif
      row_scales(scales + n * g.G, zeros + n * g.G, g.G, swf.data(), szf.data());
    if (bits == 4) row_all_m<4>(w + n * row_bytes, swf.data(), szf.data(), a, g, simd, y + n);
    else row_all_m<8>(w + n * row_bytes, swf.data(), szf.data(), a, g, simd, y + n);
  }
}

void panels_range(const uint8_t* w, int64_t panel_bytes, const c10::Half* scales,
                  const uint8_t* zeros, int bits, const Acts& a, const Geometry& g, int64_t p0,
                  int64_t p1, float* y) {
#ifdef QS_X86
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t valid = std::min<int64_t>(16, g.N - 16 * p);
    if (bits == 4)
      panel_all_m<4>(w + p * panel_bytes, scales + p * g.G * 16, zeros + p * g.G * 16, a, g,
                     16 * p, valid, y);
    else
      panel_all_m<8>(w + p * panel_bytes, scales + p * g.G * 16, zeros + p * g.G * 16, a, g,
                     16 * p, valid, y);
  }
#else
  TORCH_CHECK(false, "the panel layout needs an x86 CPU with AVX-512 VNNI");
#endif
}

}  // namespace qs_cpu

// y = x @ W^T (+ bias): x [M, K] float/bf16/fp16 -> y [M, N] in x's dtype.
// src: int32 [Kp] column gather (act-order / padding) or an empty tensor for identity + zero pad.
torch::Tensor qgemm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales,
                    const torch::Tensor& zeros, const torch::Tensor& src,
                    const c10::optional<torch::Tensor>& bias, int64_t bits, int64_t block,
                    bool allow_simd) {
  check_layout(x, w, scales, zeros, bits, block);
  Geometry g{x.size(0), w.size(0), x.size(1), bits == 4 ? 2 * w.size(1) : w.size(1),
             scales.size(1), block};
  bool simd = false;
#ifdef QS_X86
  simd = allow_simd && cpu_has_avx2();
#endif
  const Acts acts = quantize_acts(x, src, g, simd);
  std::vector<float>& y = scratch().y;
  y.resize(g.M * g.N);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const c10::Half* sp = scales.data_ptr<c10::Half>();
  const int8_t* zp = zeros.data_ptr<int8_t>();
  const int64_t row_bytes = w.size(1);
  float* yp = y.data();
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, g.Kp * g.M / 64));
  at::parallel_for(0, g.N, grain, [&](int64_t n0, int64_t n1) {
    qs_cpu::rows_range(wp, row_bytes, sp, zp, bits, acts, g, simd, n0, n1, yp);
  });
  return finish(y.data(), g.M, g.N, bias, x.scalar_type());
}

// The dense weight rows [n0, n1) in the layout's permuted, padded column order: float [n1-n0, Kp].
torch::Tensor dequant_rows(const torch::Tensor& w, const torch::Tensor& scales,
                           const torch::Tensor& zeros, int64_t bits, int64_t n0, int64_t n1) {
  TORCH_CHECK(0 <= n0 && n0 <= n1 && n1 <= w.size(0), "bad row range");
  const int64_t Kp = bits == 4 ? 2 * w.size(1) : w.size(1), G = scales.size(1), L = Kp / G;
  torch::Tensor out = torch::empty({n1 - n0, Kp}, torch::TensorOptions().dtype(torch::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const c10::Half* sp = scales.data_ptr<c10::Half>();
  const int8_t* zp = zeros.data_ptr<int8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(n0, n1, 16, [&](int64_t a, int64_t b) {
    for (int64_t n = a; n < b; ++n) {
      const uint8_t* wr = wp + n * w.size(1);
      float* o = op + (n - n0) * Kp;
      for (int64_t gi = 0; gi < G; ++gi) {
        const float s = static_cast<float>(sp[n * G + gi]);
        const float z = static_cast<float>(zp[n * G + gi]);
        if (bits == 8) {
          const int8_t* q = reinterpret_cast<const int8_t*>(wr) + gi * L;
          for (int64_t k = 0; k < L; ++k) o[gi * L + k] = (static_cast<float>(q[k]) - z) * s;
        } else {  // groups of 32 columns: half a 64-column chunk
          for (int64_t k32 = gi * L; k32 < (gi + 1) * L; k32 += 32) {
            const uint8_t* q = wr + 32 * (k32 / 64);
            const int shift = (k32 % 64) ? 4 : 0;
            for (int64_t j = 0; j < 32; ++j)
              o[k32 + j] = (static_cast<float>((q[j] >> shift) & 0x0F) - z) * s;
          }
        }
      }
    }
  });
  return out;
}

// The same product on the panel layout (AVX-512 VNNI CPUs only; see panel_vnni): y [M, n].
// amx: 1 = AMX tiles (an error where the CPU or OS has none), 0 = VNNI, -1 = AMX where it runs
// and x has at least QS_AMX_MIN_M rows.
torch::Tensor qgemm_panel_path(const torch::Tensor& x, const torch::Tensor& w,
                               const torch::Tensor& scales, const torch::Tensor& zeros,
                               const torch::Tensor& src, const c10::optional<torch::Tensor>& bias,
                               int64_t bits, int64_t block, int64_t n, int64_t amx) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D [M, K]");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(w.dim() == 3 && w.size(2) == 64 && w.scalar_type() == torch::kUInt8 &&
                  w.is_contiguous(), "w must be a contiguous uint8 [P, Kp/8 or Kp/4, 64] tensor");
  const int64_t P = w.size(0), G = scales.dim() == 3 ? scales.size(1) : 0;
  TORCH_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous() &&
                  scales.dim() == 3 && scales.size(0) == P && scales.size(2) == 16,
              "scales must be contiguous fp16 [P, G, 16]");
  TORCH_CHECK(zeros.scalar_type() == torch::kUInt8 && zeros.sizes() == scales.sizes() &&
                  zeros.is_contiguous(), "zeros must be contiguous uint8 [P, G, 16]");
  TORCH_CHECK(0 < n && n <= 16 * P && n > 16 * (P - 1), "n=", n, " does not fit ", P, " panels");
  const int64_t Kp = w.size(1) * (bits == 4 ? 8 : 4);
  TORCH_CHECK(G > 0 && Kp % G == 0 && (Kp / G) % block == 0 && block % 8 == 0,
              "Kp=", Kp, " is not G=", G, " groups of whole blocks of ", block);
#ifdef QS_X86
  TORCH_CHECK(cpu_has_vnni(), "the panel layout needs AVX-512 VNNI; prepare the rows layout");
  Geometry g{x.size(0), n, x.size(1), Kp, G, block};
  const int64_t kc = std::min<int64_t>(block, 64);  // AMX: columns of x per tile product
  const bool tiles_fit = block % kc == 0 && kc % (bits == 4 ? 8 : 4) == 0;
  TORCH_CHECK(amx != 1 || (tiles_fit && cpu_has_amx()),
              "AMX was asked for, but this CPU/OS has no AMX-INT8 or the block does not tile");
  const bool use_amx = amx == 1 || (amx == -1 && g.M >= QS_AMX_MIN_M && tiles_fit && cpu_has_amx());
  const Acts acts = quantize_acts(x, src, g, true);
  std::vector<float>& y = scratch().y;
  y.resize(g.M * n);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const c10::Half* sp = scales.data_ptr<c10::Half>();
  const uint8_t* zp = zeros.data_ptr<uint8_t>();
  float* yp = y.data();
  const int64_t panel_bytes = w.size(1) * 64;
  // at least 32 KB of weights per thread: smaller shares cost more in waking a thread
  const int64_t grain = std::max<int64_t>(1, 32768 / panel_bytes);
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    if (use_amx) {
      if (bits == 4) panel_range_amx<4>(wp, panel_bytes, sp, zp, acts, g, p0, p1, kc, yp);
      else panel_range_amx<8>(wp, panel_bytes, sp, zp, acts, g, p0, p1, kc, yp);
      return;
    }
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t valid = std::min<int64_t>(16, n - 16 * p);
      if (bits == 4)
        panel_all_m<4>(wp + p * panel_bytes, sp + p * G * 16, zp + p * G * 16, acts, g, 16 * p,
                       valid, yp);
      else
        panel_all_m<8>(wp + p * panel_bytes, sp + p * G * 16, zp + p * G * 16, acts, g, 16 * p,
                       valid, yp);
    }
  });
  return finish(y.data(), g.M, n, bias, x.scalar_type());
#else
  TORCH_CHECK(false, "the panel layout needs an x86 CPU with AVX-512 VNNI");
#endif
}

torch::Tensor qgemm_panel(const torch::Tensor& x, const torch::Tensor& w,
                          const torch::Tensor& scales, const torch::Tensor& zeros,
                          const torch::Tensor& src, const c10::optional<torch::Tensor>& bias,
                          int64_t bits, int64_t block, int64_t n) {
  return qgemm_panel_path(x, w, scales, zeros, src, bias, bits, block, n, -1);
}

// Dense rows [n0, n1) of a panel layout, in layout column order: float [n1 - n0, Kp].
torch::Tensor dequant_panel_rows(const torch::Tensor& w, const torch::Tensor& scales,
                                 const torch::Tensor& zeros, int64_t bits, int64_t n0, int64_t n1) {
  TORCH_CHECK(0 <= n0 && n0 <= n1 && n1 <= 16 * w.size(0), "bad row range");
  const int64_t steps = w.size(1), G = scales.size(1);
  const int64_t Kp = steps * (bits == 4 ? 8 : 4), L = Kp / G;
  torch::Tensor out = torch::empty({n1 - n0, Kp}, torch::TensorOptions().dtype(torch::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const c10::Half* sp = scales.data_ptr<c10::Half>();
  const uint8_t* zp = zeros.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(n0, n1, 16, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      const int64_t p = r / 16, i = r % 16;
      float* o = op + (r - n0) * Kp;
      for (int64_t j = 0; j < steps; ++j) {
        const uint8_t* q = wp + (p * steps + j) * 64 + 4 * i;
        for (int t = 0; t < 4; ++t) {
          if (bits == 4) {
            o[8 * j + t] = q[t] & 0x0F;
            o[8 * j + 4 + t] = q[t] >> 4;
          } else {
            o[4 * j + t] = q[t];
          }
        }
      }
      for (int64_t k = 0; k < Kp; ++k) {
        const int64_t gi = (p * G + k / L) * 16 + i;
        o[k] = (o[k] - static_cast<float>(zp[gi])) * static_cast<float>(sp[gi]);
      }
    }
  });
  return out;
}


bool has_amx() {
#ifdef QS_X86
  return cpu_has_amx();
#else
  return false;
#endif
}

// The same qgemm as a dispatcher op, so that compiled graphs (torch.compile) call it without a
// Python frame; its fake (meta) kernel is registered from Python (quantspec/kernels/cpu_ext.py).
TORCH_LIBRARY(quantspec_cpu, m) {
  m.def("qgemm(Tensor x, Tensor w, Tensor scales, Tensor zeros, Tensor src, Tensor? bias, "
        "int bits, int block, bool allow_simd) -> Tensor");
  m.def("qgemm_panel(Tensor x, Tensor w, Tensor scales, Tensor zeros, Tensor src, Tensor? bias, "
        "int bits, int block, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(quantspec_cpu, CPU, m) {
  m.impl("qgemm", &qgemm);
  m.impl("qgemm_panel", &qgemm_panel);
}

void register_decode_plan(pybind11::module_& m);  // cpu_decode.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_decode_plan(m);
  m.def("qgemm", &qgemm, "int8-activation x 4/8-bit weight matmul (see cpu_qgemm.cpp)");
  m.def("dequant_rows", &dequant_rows, "dense fp32 rows of a prepared layout");
  m.def("qgemm_panel", &qgemm_panel, "the same product on the panel layout (AVX-512 VNNI)");
  m.def("qgemm_panel_path", &qgemm_panel_path,
        "qgemm_panel with the path chosen: amx 1 (AMX tiles), 0 (VNNI), -1 (auto)");
  m.def("dequant_panel_rows", &dequant_panel_rows, "dense fp32 rows of a panel layout");
  m.def("has_avx2", &qs_cpu::has_avx2, "whether qgemm's AVX2 path runs on this CPU");
  m.def("has_vnni", &qs_cpu::has_vnni, "whether this CPU runs the panel layout (AVX-512 VNNI)");
  m.def("has_amx", &has_amx, "whether qgemm_panel may use AMX tiles here (CPU and OS)");
}

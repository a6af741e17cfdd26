// Float-weight products of the CPU backend (FP8 E4M3FN, FP4 E2M1 under NVFP4 / MXFP4 scales),
// as the dispatcher op quantspec_cpu::fgemm (built with cpu_qgemm.cpp into one extension; see
// quantspec/kernels/cpu_ext.py).
//
// fgemm(x [M, K] fp32 or bf16, codes uint8, scales uint8 or fp32, gscale fp32 [1], kind, group)
// -> [M, N] fp32, y = x @ dequant(W).T with unquantized activations (the declared A16 scheme):
//   kind 0, FP8: codes [N, K] E4M3FN bytes, scales fp32 [N, 1] (per output channel);
//   kind 1, NVFP4: codes [N, K/2] (column 2j low nibble, 2j+1 high), scales uint8 [N, K/16]
//     holding E4M3FN bytes, divided by gscale;
//   kind 2, MXFP4: codes as NVFP4, scales uint8 [N, K/32] holding E8M0 exponents, 2**(e - 127).
// Weights are decoded in registers (AVX2 + F16C: FP8 by moving the byte's exponent and mantissa
// into an fp16 pattern widened by vcvtph2ps, FP4 by a 16-entry byte shuffle of 2 * value),
// multiplied with x in fp32 and summed per group before the group's scale (decoded once per row);
// products are exact in fp32, sums in a fixed order. Portable loop elsewhere. Parallel over N.
// bf16 x on AVX-512 BF16 CPUs: the weights are decoded to exact bf16 values (FP8 by moving the
// exponent and mantissa into a bf16 pattern, subnormals from a table; FP4 by a 32-entry word
// permutation) and multiplied 32 at a time by vdpbf16ps (exact products, fp32 sums; the FP4
// path reads x in an order matching the nibbles, see fp4x64), the group's scale applied per 64
// columns. Other x dtypes, CPUs or shapes take the fp32 path (x widened, exactly).

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define QS_FX86 1
#endif

namespace {

constexpr float kE2M1x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

struct Fp8Table {  // the value of every E4M3FN byte (NaN bytes are never written)
  float v[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 0xF, m = b & 7;
      const float mag = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
      v[b] = (b & 0x80) ? -mag : mag;
    }
  }
};

const Fp8Table kFp8;  // built when the extension loads

inline float fp8_value(uint8_t b) { return kFp8.v[b]; }

float e8m0_value(uint8_t e) {
  if (e == 0) return std::ldexp(1.0f, -127);
  const uint32_t bits = static_cast<uint32_t>(e) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The fp32 value of each group's scale (FP4 kinds), or the channel scale (FP8).
struct Scales {
  const float* f32;       // FP8
  const uint8_t* bytes;   // FP4
  float inv_global;       // NVFP4: 1 / gscale
  int kind;
  int64_t groups;
  float at(int64_t n, int64_t g) const {
    if (kind == 0) return f32[n];
    const uint8_t b = bytes[n * groups + g];
    return kind == 1 ? fp8_value(b) * inv_global : e8m0_value(b);
  }
};

// One output row n, rows [m0, m0 + mr) of x, portable.
void row_scalar(const float* x, int64_t K, const uint8_t* c, const Scales& s, int64_t n, int64_t group,
                int kind, float* y, int64_t N, int64_t M) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    float acc = 0;
    if (kind == 0) {
      float a = 0;
      for (int64_t k = 0; k < K; ++k) a += xm[k] * fp8_value(c[k]);
      acc = a * s.at(n, 0);
    } else {
      for (int64_t g0 = 0; g0 < K; g0 += group) {
        float a = 0;
        for (int64_t k = g0; k < g0 + group; ++k) {
          const uint8_t b = c[k >> 1];
          a += xm[k] * kE2M1x2[(k & 1) ? (b >> 4) : (b & 0xF)];
        }
        acc += a * 0.5f * s.at(n, g0 / group);
      }
    }
    y[m * N + n] = acc;
  }
}

#ifdef QS_FX86
#define QS_AVX2 __attribute__((target("avx2,fma,f16c")))

QS_AVX2 inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// 16 E4M3FN bytes -> two x 8 fp32 values times 2**-8, exactly: the byte's exponent and mantissa
// placed in an fp16 pattern (sign at bit 15, eeee.mmm at bits 13..7: an fp16 of exponent bias 15
// instead of 7, subnormals included) and widened by F16C. The 2**8 goes into the row's scale.
QS_AVX2 inline void fp8x16(const uint8_t* p, __m256& w0, __m256& w1) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
  w0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  w1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// 8 bytes of FP4 codes (16 values in column order) -> 2 x 8 fp32 values of 2 * e2m1.
QS_AVX2 inline void fp4x16(const uint8_t* p, __m256& w0, __m256& w1) {
  const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i lo = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
  const __m128i v = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi));
  w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
  w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
}

// x[m, k .. k + 16) of MR rows of x, as two registers each.
template <int MR>
QS_AVX2 inline void load_x(const float* x, int64_t K, int64_t k, __m256* x0, __m256* x1) {
  for (int m = 0; m < MR; ++m) {
    x0[m] = _mm256_loadu_ps(x + m * K + k);
    x1[m] = _mm256_loadu_ps(x + m * K + k + 8);
  }
}

// Outputs of R consecutive rows of W (n .. n + R) for MR rows of x: R * MR independent
// accumulator chains (one chain would wait on the FMA latency), the decoded weights reused
// across the rows of x. ``rs``: the R rows' fp32 scales, ``ld`` apart (FP8: 1 per row; FP4: one
// per group, with the 1/2 of kE2M1x2).
template <int MR, int R>
QS_AVX2 void tile_avx2(const float* x, int64_t K, const uint8_t* c, int64_t row_bytes, const float* rs,
                       int64_t ld, int64_t group, int kind, float* y, int64_t N, int64_t n) {
  __m256 tot[MR][R];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) tot[m][r] = _mm256_setzero_ps();
  if (kind == 0) {
    for (int64_t k = 0; k < K; k += 16) {
      __m256 x0[MR], x1[MR];
      load_x<MR>(x, K, k, x0, x1);
      for (int r = 0; r < R; ++r) {
        __m256 w0, w1;
        fp8x16(c + r * row_bytes + k, w0, w1);
        for (int m = 0; m < MR; ++m)
          tot[m][r] = _mm256_fmadd_ps(x1[m], w1, _mm256_fmadd_ps(x0[m], w0, tot[m][r]));
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < R; ++r) y[m * N + n + r] = hsum(tot[m][r]) * rs[r * ld];
    return;
  }
  for (int64_t g0 = 0, g = 0; g0 < K; g0 += group, ++g) {
    __m256 acc[MR][R];
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
    for (int64_t k = g0; k < g0 + group; k += 16) {
      __m256 x0[MR], x1[MR];
      load_x<MR>(x, K, k, x0, x1);
      for (int r = 0; r < R; ++r) {
        __m256 w0, w1;
        fp4x16(c + r * row_bytes + (k >> 1), w0, w1);
        for (int m = 0; m < MR; ++m)
          acc[m][r] = _mm256_fmadd_ps(x1[m], w1, _mm256_fmadd_ps(x0[m], w0, acc[m][r]));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 sc = _mm256_broadcast_ss(rs + r * ld + g);
      for (int m = 0; m < MR; ++m) tot[m][r] = _mm256_fmadd_ps(acc[m][r], sc, tot[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) y[m * N + n + r] = hsum(tot[m][r]);
}

#define QS_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma,f16c")))

bool has_avx512_bf16() {
  static const bool ok = (__builtin_cpu_init(), __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16"));
  return ok;
}

inline uint16_t bf16_bits(float f) {  // exact for the values tabled here (at most 8 significant bits)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<uint16_t>(u >> 16);
}

struct Bf16Tables {  // 32 words each, for vpermw (which reads an index's low 5 bits)
  uint16_t fp8_sub[32];  // E4M3FN subnormal magnitudes m * 2**-9 at index m (exponent bits 0)
  uint16_t fp4[32];      // E2M1 values at index code and code + 16
  Bf16Tables() {
    for (int i = 0; i < 32; ++i) {
      fp8_sub[i] = bf16_bits(std::ldexp(static_cast<float>(i & 7), -9));
      fp4[i] = bf16_bits(0.5f * kE2M1x2[i & 15]);
    }
  }
};

const Bf16Tables kBf16;

// 32 E4M3FN bytes -> their 32 exact values as bf16. The byte sign-extended to a word and shifted
// left by 4 holds the sign at bit 15 and eeee.mmm at bits 10..4: masked, that is a bf16 of
// exponent bias 7, so adding 120 to the exponent field gives the value (normal bytes); exponent-0
// bytes take m * 2**-9 from the table (their sign added back). vdpbf16ps treats bf16 subnormals as
// zero, which this never produces (the smallest value, 2**-9, is normal in bf16).
QS_BF16 inline __m512i fp8x32(const uint8_t* p, __m512i sub_table) {
  const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  __m512i bits = _mm512_and_si512(_mm512_slli_epi16(w, 4), _mm512_set1_epi16(static_cast<short>(0x87F0)));
  bits = _mm512_add_epi16(bits, _mm512_set1_epi16(120 << 7));
  const __mmask32 sub = _mm512_testn_epi16_mask(w, _mm512_set1_epi16(0x78));
  bits = _mm512_mask_permutexvar_epi16(bits, sub, w, sub_table);
  return _mm512_ternarylogic_epi32(bits, w, _mm512_set1_epi16(static_cast<short>(0x8000)), 0xF8);  // a | (b & c)
}

// 32 bytes of FP4 codes (64 columns) -> lo: the low nibbles' values (columns 0, 2, .., 62) and
// hi: the high nibbles' (1, 3, .., 63), as bf16. x is read in the same split order (permute_x).
QS_BF16 inline void fp4x64(const uint8_t* p, __m512i table, __m512i& lo, __m512i& hi) {
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  lo = _mm512_permutexvar_epi16(w, table);  // bit 4 (the high nibble's low bit) is ignored: table[i + 16] = table[i]
  hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
}

// Accumulator lane i of a 64-column FP4 chunk covers columns 4i .. 4i + 3; its group's scale,
// from ``s`` (the row's scales from the chunk's first group on).
QS_BF16 inline __m512 chunk_scales(const float* s, int64_t group) {
  if (group % 64 == 0) return _mm512_set1_ps(*s);
  const __m512i idx = group == 16 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                                  : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(s)));
}

// Row n's group scales as fp32 (FP4 kinds), 16 at a time: the same values as Scales::at (NVFP4:
// the E4M3 byte through the fp16 pattern of fp8x16, times 2**8 / gscale; MXFP4: the E8M0 byte as
// an fp32 exponent). A scalar decode per group cost as much as the product at group 16.
QS_BF16 void decode_scales(const Scales& s, int64_t n, float* out) {
  if (s.kind == 0) {
    out[0] = s.f32[n];
    return;
  }
  const uint8_t* b = s.bytes + n * s.groups;
  int64_t g = 0;
  if (s.kind == 1) {
    const __m256 mul = _mm256_set1_ps(256.0f * s.inv_global);
    for (; g + 16 <= s.groups; g += 16) {
      __m256 v0, v1;
      fp8x16(b + g, v0, v1);  // the weights' decode: values times 2**-8
      _mm256_storeu_ps(out + g, _mm256_mul_ps(v0, mul));
      _mm256_storeu_ps(out + g + 8, _mm256_mul_ps(v1, mul));
    }
  } else if (s.kind == 2) {
    const __m512 tiny = _mm512_set1_ps(e8m0_value(0));
    for (; g + 16 <= s.groups; g += 16) {
      const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + g)));
      const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
      _mm512_storeu_ps(out + g, _mm512_mask_mov_ps(v, _mm512_testn_epi32_mask(e, e), tiny));
    }
  }
  for (; g < s.groups; ++g) out[g] = s.at(n, g);
}

// y[m, n + r] for MR rows of x (bf16; FP4: split by permute_x) and R rows of W, fp32.
template <int MR, int R>
QS_BF16 void tile_bf16(const uint16_t* x, int64_t K, const uint8_t* c, int64_t row_bytes, const float* rs,
                       int64_t ld, int64_t group, int kind, float* y, int64_t N, int64_t n) {
  __m512 acc[MR][R];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  if (kind == 0) {
    const __m512i sub = _mm512_loadu_si512(kBf16.fp8_sub);
    for (int64_t k = 0; k < K; k += 32) {
      __m512i xv[MR];
      for (int m = 0; m < MR; ++m) xv[m] = _mm512_loadu_si512(x + m * K + k);
      for (int r = 0; r < R; ++r) {
        // the next tile's rows at this column, a tile ahead (as cpu_dense's gemv_tile does)
        _mm_prefetch(reinterpret_cast<const char*>(c + (R + r) * row_bytes + k), _MM_HINT_T0);
        const __m512i w = fp8x32(c + r * row_bytes + k, sub);
        for (int m = 0; m < MR; ++m) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], (__m512bh)xv[m], (__m512bh)w);
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < R; ++r) y[m * N + n + r] = _mm512_reduce_add_ps(acc[m][r]) * rs[r * ld];
    return;
  }
  const __m512i table = _mm512_loadu_si512(kBf16.fp4);
  for (int64_t k = 0; k < K; k += 64) {
    __m512i xe[MR], xo[MR];
    for (int m = 0; m < MR; ++m) {
      xe[m] = _mm512_loadu_si512(x + m * K + k);
      xo[m] = _mm512_loadu_si512(x + m * K + k + 32);
    }
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(c + (R + r) * row_bytes + (k >> 1)), _MM_HINT_T0);
      __m512i lo, hi;
      fp4x64(c + r * row_bytes + (k >> 1), table, lo, hi);
      const __m512 sc = chunk_scales(rs + r * ld + k / group, group);
      for (int m = 0; m < MR; ++m) {
        const __m512 part = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)xe[m], (__m512bh)lo),
                                             (__m512bh)xo[m], (__m512bh)hi);
        acc[m][r] = _mm512_fmadd_ps(part, sc, acc[m][r]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) y[m * N + n + r] = _mm512_reduce_add_ps(acc[m][r]);
}

bool has_avx2_fma() {
  static const bool ok = (__builtin_cpu_init(), __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c"));
  return ok;
}
#endif

#ifdef QS_FX86
// x's 64-column chunks reordered as fp4x64 decodes the weights: even columns, then odd ones.
torch::Tensor permute_x(const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  return x.view({M, K / 64, 32, 2}).transpose(2, 3).contiguous().view({M, K});
}

// The bf16 path (see the header); false where it does not apply (then the fp32 path runs).
bool fgemm_bf16(const torch::Tensor& x, const uint8_t* cp, int64_t row_bytes, const Scales& s, int kind,
                int64_t group, float* yp, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
  const bool shape_ok = kind == 0 ? K % 32 == 0 : (K % 64 == 0 && (group == 16 || group == 32 || group % 64 == 0));
  if (x.scalar_type() != torch::kBFloat16 || !has_avx512_bf16() || !shape_ok) return false;
  const torch::Tensor xb = kind == 0 ? x.contiguous() : permute_x(x.contiguous());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  constexpr int64_t R = 4;
  at::parallel_for(0, (N + R - 1) / R, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, K)), [&](int64_t t0, int64_t t1) {
    std::vector<float> rs(R * s.groups + 4);  // + 4: chunk_scales loads 4 floats
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t * R, rows = std::min<int64_t>(R, N - n);
      for (int64_t r = 0; r < rows; ++r) decode_scales(s, n + r, rs.data() + r * s.groups);
      const uint8_t* c = cp + n * row_bytes;
      for (int64_t m = 0; m < M;) {
        int64_t mr = rows == R ? std::min<int64_t>(M - m, 4) : 1;
        if (mr == 3) mr = 2;
        const uint16_t* xm = xp + m * K;
        float* ym = yp + m * N;
        const float* r0 = rs.data();
        if (rows == R && mr == 1) {
          tile_bf16<1, 4>(xm, K, c, row_bytes, r0, s.groups, group, kind, ym, N, n);
        } else if (rows == R && mr == 2) {
          tile_bf16<2, 4>(xm, K, c, row_bytes, r0, s.groups, group, kind, ym, N, n);
        } else if (rows == R && mr == 4) {  // 2 x 4 tiles: 8 accumulators of 32 registers
          tile_bf16<4, 2>(xm, K, c, row_bytes, r0, s.groups, group, kind, ym, N, n);
          tile_bf16<4, 2>(xm, K, c + 2 * row_bytes, row_bytes, r0 + 2 * s.groups, s.groups, group, kind, ym, N, n + 2);
        } else {
          for (int64_t r = 0; r < rows; ++r)
            tile_bf16<1, 1>(xm, K, c + r * row_bytes, row_bytes, r0 + r * s.groups, s.groups, group, kind, ym, N, n + r);
        }
        m += mr;
      }
    }
  });
  return true;
}
#endif

torch::Tensor fgemm(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                    const torch::Tensor& gscale, int64_t kind, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16),
              "fgemm: x must be fp32 or bf16 [M, K]");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kByte && codes.is_contiguous(),
              "fgemm: codes must be contiguous uint8");
  TORCH_CHECK(kind >= 0 && kind <= 2, "fgemm: kind is 0 (FP8), 1 (NVFP4) or 2 (MXFP4)");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(codes.size(1) == (kind == 0 ? K : K / 2), "fgemm: codes do not match K");
  TORCH_CHECK(kind == 0 ? K % 16 == 0 : (group % 16 == 0 && K % group == 0),
              "fgemm: K must be a multiple of 16 (FP8) or of the group (FP4, groups of 16 / 32)");
  Scales s{nullptr, nullptr, 1.0f, static_cast<int>(kind), kind == 0 ? 1 : K / group};
  if (kind == 0) {
    TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.numel() == N && scales.is_contiguous(),
                "fgemm: FP8 scales must be contiguous fp32 [N, 1]");
    s.f32 = scales.data_ptr<float>();
  } else {
    TORCH_CHECK(scales.scalar_type() == torch::kByte && scales.numel() == N * s.groups && scales.is_contiguous(),
                "fgemm: FP4 scales must be contiguous uint8 [N, K / group]");
    s.bytes = scales.data_ptr<uint8_t>();
    if (kind == 1) s.inv_global = 1.0f / gscale.item<float>();
  }
  torch::Tensor y = torch::empty({M, N}, torch::TensorOptions().dtype(torch::kFloat));
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t row_bytes = codes.size(1);
#ifdef QS_FX86
  if (fgemm_bf16(x, cp, row_bytes, s, static_cast<int>(kind), group, yp, N)) return y;
#endif
  const torch::Tensor xc = x.to(torch::kFloat).contiguous();
  const float* xp = xc.data_ptr<float>();
  constexpr int64_t R = 4;  // rows of W per tile
  at::parallel_for(0, (N + R - 1) / R, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, K)), [&](int64_t t0, int64_t t1) {
#ifdef QS_FX86
    std::vector<float> rs(R * s.groups);
#endif
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t * R, rows = std::min<int64_t>(R, N - n);
#ifdef QS_FX86
      if (has_avx2_fma()) {
        // the rows' scales decoded once: FP8 with the 2**8 of fp8x16, FP4 with kE2M1x2's 1/2
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t g = 0; g < s.groups; ++g) rs[r * s.groups + g] = (kind == 0 ? 256.0f : 0.5f) * s.at(n + r, g);
        const uint8_t* c = cp + n * row_bytes;
        for (int64_t m = 0; m < M;) {
          const int64_t mr = std::min<int64_t>(M - m, 4);
          float* ym = yp + m * N;
          const float* xm = xp + m * K;
          if (rows == R && mr == 1) tile_avx2<1, 4>(xm, K, c, row_bytes, rs.data(), s.groups, group, kind, ym, N, n);
          else if (rows == R && mr == 2) tile_avx2<2, 4>(xm, K, c, row_bytes, rs.data(), s.groups, group, kind, ym, N, n);
          else if (rows == R && mr == 4) tile_avx2<4, 4>(xm, K, c, row_bytes, rs.data(), s.groups, group, kind, ym, N, n);
          else {  // a partial tile, or 3 rows of x: one row of W and one row of x at a time
            for (int64_t r = 0; r < rows; ++r)
              for (int64_t mm = 0; mm < mr; ++mm)
                tile_avx2<1, 1>(xm + mm * K, K, c + r * row_bytes, row_bytes, rs.data() + r * s.groups, s.groups,
                                group, kind, ym + mm * N, N, n + r);
          }
          m += mr;
        }
        continue;
      }
#endif
      for (int64_t r = 0; r < rows; ++r) row_scalar(xp, K, cp + (n + r) * row_bytes, s, n + r, group, kind, yp, N, M);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(quantspec_cpu, m) {
  m.def("fgemm(Tensor x, Tensor codes, Tensor scales, Tensor gscale, int kind, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(quantspec_cpu, CPU, m) { m.impl("fgemm", &fgemm); }

// Float-weight products of the CPU backend (FP8 E4M3FN, FP4 E2M1 under NVFP4 / MXFP4 scales),
// as the dispatcher op quantspec_cpu::fgemm (built with cpu_qgemm.cpp into one extension; see
// quantspec/kernels/cpu_ext.py).
//
// fgemm(x [M, K] fp32, codes uint8, scales uint8 or fp32, gscale fp32 [1], kind, group) -> [M, N]
// fp32, y = x @ dequant(W).T with unquantized activations (the declared A16 scheme):
//   kind 0, FP8: codes [N, K] E4M3FN bytes, scales fp32 [N, 1] (per output channel);
//   kind 1, NVFP4: codes [N, K/2] (column 2j low nibble, 2j+1 high), scales uint8 [N, K/16]
//     holding E4M3FN bytes, divided by gscale;
//   kind 2, MXFP4: codes as NVFP4, scales uint8 [N, K/32] holding E8M0 exponents, 2**(e - 127).
// Weights are decoded in registers (AVX2 + F16C: FP8 by moving the byte's exponent and mantissa
// into an fp16 pattern widened by vcvtph2ps, FP4 by a 16-entry byte shuffle of 2 * value),
// multiplied with x in fp32 and summed per group before the group's scale (decoded once per row);
// products are exact in fp32, sums in a fixed order. Portable loop elsewhere. Parallel over N.

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

bool has_avx2_fma() {
  static const bool ok = (__builtin_cpu_init(), __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c"));
  return ok;
}
#endif

torch::Tensor fgemm(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                    const torch::Tensor& gscale, int64_t kind, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "fgemm: x must be fp32 [M, K]");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kByte && codes.is_contiguous(),
              "fgemm: codes must be contiguous uint8");
  TORCH_CHECK(kind >= 0 && kind <= 2, "fgemm: kind is 0 (FP8), 1 (NVFP4) or 2 (MXFP4)");
  const torch::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = codes.size(0);
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
  const float* xp = xc.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t row_bytes = codes.size(1);
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

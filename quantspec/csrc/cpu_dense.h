// The small dense ops of cpu_dense.cpp for other sources of the same extension (cpu_decode.cpp),
// called directly rather than through the dispatcher. Each is the op of the same name there.
#pragma once

#include <torch/extension.h>

#include <optional>

namespace qs_cpu {

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up);
torch::Tensor f32_gemv(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor bf16_gemv(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor kc,
                     torch::Tensor vc, int64_t lo, double scale,
                     const std::optional<torch::Tensor>& sinks, int64_t window);

}  // namespace qs_cpu

// cpu_qgemm.cpp's products (the ops qgemm and qgemm_panel).
torch::Tensor qgemm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales,
                    const torch::Tensor& zeros, const torch::Tensor& src,
                    const std::optional<torch::Tensor>& bias, int64_t bits, int64_t block,
                    bool allow_simd);
torch::Tensor qgemm_panel(const torch::Tensor& x, const torch::Tensor& w,
                          const torch::Tensor& scales, const torch::Tensor& zeros,
                          const torch::Tensor& src, const std::optional<torch::Tensor>& bias,
                          int64_t bits, int64_t block, int64_t n);

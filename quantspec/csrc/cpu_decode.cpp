// DecodePlan: the dense blocks of a decode step as one C++ loop (quantspec/runtime/decode_plan.py).
//
// runtime/decoder.py's StaticDecoder runs each block as about a dozen calls of the extension's
// ops from Python. On a small model each op is short (a 4-bit draft of SmolLM2-135M: 121
// products, 30 attentions, 60 norms per token), and the Python around the calls, each call's
// argument checks and the dispatcher cost about as much as the ops themselves. A plan holds
// every block's tensors and constants, built once from the decoder's own modules, and runs the
// same calls, in the same order and with the same arguments, from C++: the same arithmetic,
// so the same bits as the Python loop (tests/test_decode_plan.py).
//
// Per block (the no-holes branch of StaticDecoder._blocks, a dense MLP):
//   y = rms_norm(x, attn_norm); q, k, v = qkv(y) (viewed [B, t, heads, D]); optional q/k norms;
//   o = attend(q, k, v, cos, sin, k_cache, v_cache, lo, D^-0.5, sinks, window)
//   x = x + out(o); y = rms_norm(x, mlp_norm); gate, up = gate_up(y); x = x + down(silu_mul(gate, up))
// A product (DecodeLinear) is one of:
//   kind 0, dense: x @ w.T (+ bias), through f32_gemv / bf16_gemv for min_rows..max_rows rows of
//     x's dtype (kernels/dense.py's DenseGemv), else at::linear (nn.Linear's own product);
//   kind 1, qgemm on the rows layout, kind 2, qgemm_panel on the panel layout (kernels/cpu.py's
//     BoundQGemm; the caller keeps rows below its DENSE_FROM_M).
// qkv and gate_up are either one product split into `sizes` (kernels/siblings.py, fused) or one
// product per output.

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "cpu_dense.h"

namespace {

constexpr int64_t DENSE = 0, QGEMM = 1, QGEMM_PANEL = 2;

struct DecodeLinear {
  int64_t kind;
  torch::Tensor w, scales, zeros, src;
  std::optional<torch::Tensor> bias;
  int64_t bits, block, n, min_rows, max_rows;

  torch::Tensor operator()(const torch::Tensor& x) const {
    const int64_t K = x.size(-1), rows = K ? x.numel() / K : 0;
    std::vector<int64_t> shape = x.sizes().vec();
    if (kind == DENSE) {
      if (rows < min_rows || rows > max_rows || x.scalar_type() != w.scalar_type())
        return at::linear(x, w, bias);
      const torch::Tensor x2 = x.reshape({rows, K});
      torch::Tensor y = w.scalar_type() == torch::kFloat ? qs_cpu::f32_gemv(x2, w)
                                                         : qs_cpu::bf16_gemv(x2, w);
      if (bias) y = y + *bias;
      shape.back() = w.size(0);
      return y.reshape(shape);
    }
    torch::Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, K});
    if (!x2.is_contiguous()) x2 = x2.contiguous();
    const torch::Tensor y = kind == QGEMM_PANEL
                                ? qgemm_panel(x2, w, scales, zeros, src, bias, bits, block, n)
                                : qgemm(x2, w, scales, zeros, src, bias, bits, block, true);
    if (x.dim() == 2) return y;
    shape.back() = y.size(1);
    return y.view(shape);
  }
};

// Linears of one input: one product split into `sizes`, or one product per output.
struct Siblings {
  std::vector<DecodeLinear> parts;
  std::vector<int64_t> sizes;

  std::vector<torch::Tensor> operator()(const torch::Tensor& x) const {
    if (parts.size() == 1 && sizes.size() > 1) return parts[0](x).split_with_sizes(sizes, -1);
    std::vector<torch::Tensor> out;
    out.reserve(parts.size());
    for (const DecodeLinear& part : parts) out.push_back(part(x));
    return out;
  }
};

struct Block {
  torch::Tensor attn_norm, mlp_norm;
  std::optional<torch::Tensor> q_norm, k_norm, sinks;  // sinks: fp32, contiguous
  int64_t window;
  Siblings qkv, gate_up;
  DecodeLinear out, down;
};

class DecodePlan {
 public:
  DecodePlan(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps)
      : heads_(heads), kv_(kv_heads), d_(head_dim), eps_(eps),
        scale_(std::pow(static_cast<double>(head_dim), -0.5)) {}

  void add_block(torch::Tensor attn_norm, torch::Tensor mlp_norm,
                 std::optional<torch::Tensor> q_norm, std::optional<torch::Tensor> k_norm,
                 std::optional<torch::Tensor> sinks, int64_t window,
                 std::vector<DecodeLinear> qkv, std::vector<int64_t> qkv_sizes, DecodeLinear out,
                 std::vector<DecodeLinear> gate_up, std::vector<int64_t> gate_up_sizes,
                 DecodeLinear down) {
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "DecodePlan: q and k norms go together");
    TORCH_CHECK((qkv.size() == 1 && qkv_sizes.size() == 3) || qkv.size() == 3,
                "DecodePlan: qkv is one product split in three, or three products");
    TORCH_CHECK((gate_up.size() == 1 && gate_up_sizes.size() == 2) || gate_up.size() == 2,
                "DecodePlan: gate_up is one product split in two, or two products");
    blocks_.push_back(Block{std::move(attn_norm), std::move(mlp_norm), std::move(q_norm),
                            std::move(k_norm), std::move(sinks), window,
                            Siblings{std::move(qkv), std::move(qkv_sizes)},
                            Siblings{std::move(gate_up), std::move(gate_up_sizes)},
                            std::move(out), std::move(down)});
  }

  int64_t blocks() const { return static_cast<int64_t>(blocks_.size()); }

  // x [B, t, hidden] at cache columns [lo, lo + t) -> the last block's output [B, t, hidden];
  // writes each block's keys and values into k_caches[i], v_caches[i] [B, KV, cap, D].
  torch::Tensor run(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                    const std::vector<torch::Tensor>& k_caches,
                    const std::vector<torch::Tensor>& v_caches, int64_t lo) const {
    TORCH_CHECK(x.dim() == 3, "DecodePlan.run: x must be [B, t, hidden]");
    TORCH_CHECK(k_caches.size() == blocks_.size() && v_caches.size() == blocks_.size(),
                "DecodePlan.run: one key and one value cache per block");
    const int64_t b = x.size(0), t = x.size(1);
    for (size_t i = 0; i < blocks_.size(); ++i) {
      const Block& blk = blocks_[i];
      torch::Tensor y = qs_cpu::rms_norm(x, blk.attn_norm, eps_);
      std::vector<torch::Tensor> qkv = blk.qkv(y);
      torch::Tensor q = qkv[0].view({b, t, heads_, d_});
      torch::Tensor k = qkv[1].view({b, t, kv_, d_});
      const torch::Tensor v = qkv[2].view({b, t, kv_, d_});
      if (blk.q_norm) {
        q = qs_cpu::rms_norm(q, *blk.q_norm, eps_);
        k = qs_cpu::rms_norm(k, *blk.k_norm, eps_);
      }
      const torch::Tensor o = qs_cpu::attend(q, k, v, cos, sin, k_caches[i], v_caches[i], lo,
                                             scale_, blk.sinks, blk.window);
      x = x + blk.out(o);
      y = qs_cpu::rms_norm(x, blk.mlp_norm, eps_);
      std::vector<torch::Tensor> gu = blk.gate_up(y);
      x = x + blk.down(qs_cpu::silu_mul(gu[0], gu[1]));
    }
    return x;
  }

 private:
  int64_t heads_, kv_, d_;
  double eps_, scale_;
  std::vector<Block> blocks_;
};

}  // namespace

void register_decode_plan(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<DecodeLinear>(m, "DecodeLinear",
                           "one product of a DecodePlan block (kind 0 dense, 1 qgemm, 2 qgemm_panel)")
      .def(py::init([](int64_t kind, torch::Tensor w, torch::Tensor scales, torch::Tensor zeros,
                       torch::Tensor src, std::optional<torch::Tensor> bias, int64_t bits,
                       int64_t block, int64_t n, int64_t min_rows, int64_t max_rows) {
             TORCH_CHECK(kind == DENSE || kind == QGEMM || kind == QGEMM_PANEL,
                         "DecodeLinear: kind must be 0, 1 or 2, got ", kind);
             return DecodeLinear{kind, std::move(w), std::move(scales), std::move(zeros),
                                 std::move(src), std::move(bias), bits, block, n, min_rows,
                                 max_rows};
           }),
           py::arg("kind"), py::arg("w"), py::arg("scales"), py::arg("zeros"), py::arg("src"),
           py::arg("bias"), py::arg("bits"), py::arg("block"), py::arg("n"), py::arg("min_rows"),
           py::arg("max_rows"))
      .def("__call__", &DecodeLinear::operator(), py::arg("x"));
  py::class_<DecodePlan>(m, "DecodePlan", "a decode step's dense blocks as one C++ loop")
      .def(py::init<int64_t, int64_t, int64_t, double>(), py::arg("heads"), py::arg("kv_heads"),
           py::arg("head_dim"), py::arg("eps"))
      .def("add_block", &DecodePlan::add_block)
      .def("blocks", &DecodePlan::blocks)
      .def("run", &DecodePlan::run, py::arg("x"), py::arg("cos"), py::arg("sin"),
           py::arg("k_caches"), py::arg("v_caches"), py::arg("lo"),
           py::call_guard<py::gil_scoped_release>());
}

// Torch glue of the GPU jakiro::decoder_layer and decoder_layers (its layers one after the other):
// the composition of csrc/decoder_layer.h over this backend's own ops (jakiro::* on CUDA; under
// the emulator, its namespace's), called through the dispatcher from C++: the GPU kernels of the
// parts, launched in order on the current stream.
#include <ATen/core/dispatch/Dispatcher.h>

#include "cuda/launch.h"
#include "decoder_layer.h"
#include "ops.h"

namespace jakiro::gpu {
namespace {

#if defined(SIMT_EMU)
#define JAKIRO_STRINGIFY_(x) #x
#define JAKIRO_STRINGIFY(x) JAKIRO_STRINGIFY_(x)
constexpr const char* kNamespace = JAKIRO_STRINGIFY(JAKIRO_SIMT_NAMESPACE);
#else
constexpr const char* kNamespace = "jakiro";
#endif

// The op `name` of this backend's namespace, with signature Fn, looked up once.
template <typename Fn>
c10::TypedOperatorHandle<Fn> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow((std::string(kNamespace) + "::" + name).c_str(), "").typed<Fn>();
}

using Opt = std::optional<at::Tensor>;
using T = at::Tensor;

struct DispatchedOps {
  static constexpr bool kBf16Weights = false, kBf16Cache = false;  // (one dtype: the GPU kernels)
  std::tuple<T, T> rms_norm(const T& x, const T& w, double eps, const Opt& residual) const {
    static const auto handle = op_handle<std::tuple<T, T>(const T&, const T&, double, const Opt&)>("rms_norm");
    return handle.call(x, w, eps, residual);
  }
  T linear(const T& x, const T& w, const Opt& b) const {
    static const auto handle = op_handle<T(const T&, const T&, const Opt&)>("linear");
    return handle.call(x, w, b);
  }
  T rope_kv_write(const T& qkv, const T& cos, const T& sin, const T& kv_cache, const T& lengths) const {
    static const auto handle = op_handle<T(const T&, const T&, const T&, const T&, const T&)>("rope_kv_write");
    return handle.call(qkv, cos, sin, kv_cache, lengths);
  }
  T tree_attention(const T& q, const T& k, const T& v, const T& lengths, const T& mask) const {
    static const auto handle =
        op_handle<std::tuple<T, T>(const T&, const T&, const T&, const T&, const T&, std::optional<double>,
                                   std::optional<int64_t>)>("tree_attention");
    return std::get<0>(handle.call(q, k, v, lengths, mask, std::nullopt, std::nullopt));
  }
  T silu_mul(const T& gate_up) const {
    static const auto handle = op_handle<T(const T&)>("silu_mul");
    return handle.call(gate_up);
  }
};

std::tuple<T, T> decoder_layer_gpu(const T& delta, const Opt& residual, const T& input_norm, const T& qkv_weight,
                                   const Opt& qkv_bias, const T& o_weight, const T& post_norm, const T& gate_up_weight,
                                   const T& down_weight, const T& cos, const T& sin, const T& kv_cache,
                                   const T& lengths, const T& tree_mask, double eps) {
  const DeviceScope scope(delta);
  return compose_decoder_layer(DispatchedOps{}, delta, residual, input_norm, qkv_weight, qkv_bias, o_weight, post_norm,
                               gate_up_weight, down_weight, cos, sin, kv_cache, lengths, tree_mask, eps);
}

// The layers one after the other (each as above).
std::tuple<T, T> decoder_layers_gpu(const T& delta, const Opt& residual, at::TensorList input_norms,
                                    at::TensorList qkv_weights, at::TensorList qkv_biases, at::TensorList o_weights,
                                    at::TensorList post_norms, at::TensorList gate_up_weights,
                                    at::TensorList down_weights, const T& cos, const T& sin, const T& kv_cache,
                                    const T& lengths, const T& tree_mask, double eps) {
  check_decoder_layers(delta, residual, input_norms, qkv_weights, qkv_biases, o_weights, post_norms, gate_up_weights,
                       down_weights, cos, sin, kv_cache, lengths, tree_mask, eps, DispatchedOps::kBf16Weights);
  return compose_decoder_layers(&decoder_layer_gpu, delta, residual, input_norms, qkv_weights, qkv_biases, o_weights,
                                post_norms, gate_up_weights, down_weights, cos, sin, kv_cache, lengths, tree_mask,
                                eps);
}

}  // namespace

JAKIRO_GPU_LIBRARY_IMPL(m) {
  m.impl("decoder_layer", &decoder_layer_gpu);
  m.impl("decoder_layers", &decoder_layers_gpu);
}

}  // namespace jakiro::gpu

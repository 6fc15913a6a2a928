// The CPU merge of split-KV partial attention states (merge_attention_states.cpp); tree
// attention ends with it.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace jakiro::cpu {

std::tuple<at::Tensor, at::Tensor> merge_attention_states_cpu(const at::Tensor& out_partial,
                                                              const at::Tensor& lse_partial,
                                                              std::optional<at::ScalarType> out_dtype);

}  // namespace jakiro::cpu

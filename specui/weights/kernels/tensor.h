// What SpecUI's kernels need of torch, without <torch/extension.h>: ATen's Tensor, a new CPU
// tensor, the dtypes and parallel_for. That header brings pybind11 and torch's whole C++ API into
// every file (32 s a file on a 2-core Zen 3), <ATen/ops/empty.h> every operator's declarations
// (6.5 s); these take about 3.5 s. module.cpp binds the kernels to Python and to torch's operator
// registry.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/EmptyTensor.h>
#include <c10/util/Exception.h>

namespace torch {
// a new tensor on the CPU allocator, as at::empty makes one for CPU options (every kernel's inputs are
// on the CPU), without the dispatcher's declarations of every operator
inline at::Tensor empty(at::IntArrayRef size, const at::TensorOptions& options) {
  return at::detail::empty_cpu(size, options);
}
using at::Tensor;
// torch/types.h's names for the dtypes
constexpr auto kUInt8 = at::kByte;
constexpr auto kInt8 = at::kChar;
constexpr auto kInt16 = at::kShort;
constexpr auto kFloat16 = at::kHalf;
constexpr auto kFloat32 = at::kFloat;
constexpr auto kFloat64 = at::kDouble;
using at::kBFloat16;
using at::kBool;
}  // namespace torch

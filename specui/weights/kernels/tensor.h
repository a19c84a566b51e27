// What SpecUI's kernels need of torch, without <torch/extension.h>: ATen's Tensor, empty, the
// dtypes and parallel_for. That header brings pybind11 and torch's whole C++ API into every file
// (32 s a file on a 2-core Zen 3, against about 4 s for these); only module.cpp, which binds the
// kernels to Python and to torch's operator registry, includes it.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

namespace torch {
using at::empty;
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

// SpecUI's native CPU kernels as one Python extension (specui/weights/native.py builds it).
// torch's operator registry and pybind11 with torch's Tensor casters, not <torch/extension.h>: that
// header brings torch's whole C++ API (32 s to compile on a 2-core Zen 3, against 13 s for these).
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>
#include <string>
#include "tensor.h"
#include <tuple>

torch::Tensor stream_mm(torch::Tensor x, torch::Tensor w);                                           // stream.cpp
std::string instructions();                                                                          // stream.cpp
std::tuple<torch::Tensor, torch::Tensor> round_rows(torch::Tensor x, double levels, double zero);  // rows.cpp
torch::Tensor scale_rows(torch::Tensor product, torch::Tensor top);                                 // rows.cpp
torch::Tensor q4a8_mm(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t N);          // q4a8.cpp
torch::Tensor q4a8_mm_portable(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t N); // q4a8.cpp
torch::Tensor q4a8_mm_from(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t N,
                           int64_t amx_from);                                                       // q4a8.cpp
int64_t q4a8_amx_from();                                                                            // q4a8.cpp
bool q4a8_vector();                                                                                 // q4a8.cpp
std::string q4a8_path();                                                                            // q4a8.cpp
torch::Tensor q8a8_mm(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t N);          // q8a8.cpp
torch::Tensor q8a8_mm_portable(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t N); // q8a8.cpp
bool q8a8_vector();                                                                                 // q8a8.cpp
std::string q8a8_path();                                                                            // q8a8.cpp
torch::Tensor attend(torch::Tensor query, torch::Tensor key, torch::Tensor value, torch::Tensor allowed,
                     double scale);                                                                 // attend.cpp
torch::Tensor row_stats(torch::Tensor rows, bool lse);                                              // logits.cpp
torch::Tensor softmax_stats(torch::Tensor rows, int64_t k);                                         // entropy.cpp
std::tuple<int64_t, double, int64_t> int8_dot_roof(int64_t steps);                                  // roof.cpp

// The products and the attention as torch operators too (torch.ops.specui_native.*): what compiled
// forwards call. A Python custom op costs ~35 us a call on a 2-core Zen 3 where the dispatcher's path to
// C++ costs a few, and a w4a8 token calls 211 of them. Their shapes for torch.compile: native.py.
TORCH_LIBRARY(specui_native, m) {
  m.def("q4a8_mm(Tensor x, Tensor packed, Tensor scales, int n) -> Tensor");
  m.def("q8a8_mm(Tensor x, Tensor packed, Tensor scales, int n) -> Tensor");
  m.def("stream_mm(Tensor x, Tensor w) -> Tensor");
  m.def("attend(Tensor query, Tensor key, Tensor value, Tensor allowed, float scale) -> Tensor");
  m.def("row_stats(Tensor rows, bool lse) -> Tensor");
  m.def("softmax_stats(Tensor rows, int k) -> Tensor");
}

TORCH_LIBRARY_IMPL(specui_native, CPU, m) {
  m.impl("q4a8_mm", &q4a8_mm);
  m.impl("q8a8_mm", &q8a8_mm);
  m.impl("stream_mm", &stream_mm);
  m.impl("attend", &attend);
  m.impl("row_stats", &row_stats);
  m.impl("softmax_stats", &softmax_stats);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("stream_mm", &stream_mm);
  m.def("instructions", &instructions);
  m.def("round_rows", &round_rows);
  m.def("scale_rows", &scale_rows);
  m.def("q4a8_mm", &q4a8_mm);
  m.def("q4a8_mm_portable", &q4a8_mm_portable);
  m.def("q4a8_mm_from", &q4a8_mm_from);
  m.def("q4a8_amx_from", &q4a8_amx_from);
  m.def("q4a8_vector", &q4a8_vector);
  m.def("q4a8_path", &q4a8_path);
  m.def("q8a8_mm", &q8a8_mm);
  m.def("q8a8_mm_portable", &q8a8_mm_portable);
  m.def("q8a8_vector", &q8a8_vector);
  m.def("q8a8_path", &q8a8_path);
  m.def("attend", &attend);
  m.def("row_stats", &row_stats);
  m.def("softmax_stats", &softmax_stats);
  m.def("int8_dot_roof", &int8_dot_roof);
}

// SpecUI's native CPU kernels as one Python extension (specui/weights/native.py builds it).
#include <torch/extension.h>
#include <string>
#include <tuple>

torch::Tensor stream_mm(torch::Tensor x, torch::Tensor w);                                           // stream.cpp
std::string instructions();                                                                          // stream.cpp
std::tuple<torch::Tensor, torch::Tensor> round_rows(torch::Tensor x, double levels, double zero);  // rows.cpp
torch::Tensor scale_rows(torch::Tensor product, torch::Tensor top);                                 // rows.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("stream_mm", &stream_mm);
  m.def("instructions", &instructions);
  m.def("round_rows", &round_rows);
  m.def("scale_rows", &scale_rows);
}

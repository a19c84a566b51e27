// One translation unit for several of SpecUI's kernel files (specui/weights/native.py builds three
// such units and module.cpp): ATen's headers are then read once a unit, not once a file (3.5 s a file
// on a 2-core Zen 3, where the kernels' own code takes 0.5-3 s). Files whose file-local names would
// clash (hsum, kGrain; kRows, half_to_float, ...) are in different units.
#include "stream.cpp"
#include "rows.cpp"

// One translation unit for several of SpecUI's kernel files (specui/weights/native.py builds three
// such units and module.cpp): ATen's headers are then read once a unit, not once a file (3.5 s a file
// on a 2-core Zen 3, where the kernels' own code takes 0.5-3 s). Files whose file-local names would
// clash on some CPU (entropy, logits and stream: hsum, kGrain; q4a8, q4a8_amx and q8a8: kRows,
// kAhead, micro, ... under AMX) are in different units.
#include "q8a8.cpp"
#include "rows.cpp"
#include "stream.cpp"

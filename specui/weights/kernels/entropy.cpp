// What SpecDec++'s acceptance head and MCSD's entropy decision model read of a draft's logits
// (heads/acceptance.py's q_stats), in one pass over them on every thread:
//   softmax_stats(rows (M, V) float32, k) -> (M, 2 + k) float64, row m: [lse, entropy, top_1 .. top_k]
//   lse = log(sum_v exp(x_v)), entropy = -sum_v p_v log p_v with p = softmax(x) (0 log 0 = 0, so the
//   -inf columns of a draft head over a reduced vocabulary add nothing), top_j = the j-th largest p_v
//   (descending; 0 past the row's finite entries). A row with a NaN or a +inf, or with every entry
//   -inf, gives NaN everywhere (torch's softmax has no finite answer there; the caller recomputes it).
// Why a kernel: torch computes these as a softmax, an entropy over it and a top-k, each a pass over the
// 49k-entry row (and the older log_softmax + exp spent most of its time on the lanes of exp(-inf)); the
// row was just written by the draft head's threads, each its own span of columns, so every pass read
// on one thread pays for the other core's lines: 216 us a row inside the decoding loop on a 2-core
// Zen 5. Here each thread scans its span once for the maximum and once for the exponential sums and a
// running top-k, and the spans are combined.
#include "tensor.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "vexp.h"  // and <immintrin.h>, where AVX2 and FMA are there

namespace {

constexpr int64_t kGrain = 4096;  // columns a thread takes at least (the draft head's split)
constexpr int64_t kMaxK = 16;     // top probabilities a row may ask for

struct Span {
  float top = -std::numeric_limits<float>::infinity();  // this span's maximum
  bool bad = false;                                      // a NaN or a +inf in the span
  double sum = 0.0;                                      // sum of exp(x - top)
  double moment = 0.0;                                   // sum of exp(x - top) * (x - top)
  int64_t count = 0;                                     // entries in `largest`
  float largest[kMaxK];                                  // the span's largest entries, descending
};

inline void keep(Span& s, int64_t k, float v) {  // v enters the span's top k (if it is larger than its last)
  int64_t i = std::min(s.count, k - 1);
  if (s.count == k && v <= s.largest[k - 1]) return;
  while (i > 0 && s.largest[i - 1] < v) {
    s.largest[i] = s.largest[i - 1];
    --i;
  }
  s.largest[i] = v;
  s.count = std::min(s.count + 1, k);
}

#if defined(__AVX2__) && defined(__FMA__)
using specui_vec::exp8;
using specui_vec::hmax8;

inline double hsum(__m256 v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  double s = 0.0;
  for (float lane : lanes) s += lane;
  return s;
}
#endif

// columns [b, e) of one row
void scan(const float* x, int64_t b, int64_t e, int64_t k, Span& s) {
  if (b >= e) return;
  const float inf = std::numeric_limits<float>::infinity();
  int64_t i = b;
  float top = -inf;
  bool bad = false;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 vtop = _mm256_set1_ps(-inf), vbad = _mm256_setzero_ps();
  const __m256 vinf = _mm256_set1_ps(inf);
  for (; i + 8 <= e; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    vbad = _mm256_or_ps(vbad, _mm256_or_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q), _mm256_cmp_ps(v, vinf, _CMP_EQ_OQ)));
    vtop = _mm256_max_ps(vtop, v);
  }
  top = hmax8(vtop);
  bad = _mm256_movemask_ps(vbad) != 0;
#endif
  for (; i < e; ++i) {
    bad |= std::isnan(x[i]) || x[i] == inf;
    top = std::max(top, x[i]);
  }
  s.top = top, s.bad = bad;
  if (bad || top == -inf) return;  // no terms (all -inf) or no finite answer
  i = b;
  double sum = 0.0, moment = 0.0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 vt = _mm256_set1_ps(top);
  __m256 acc = _mm256_setzero_ps(), mom = _mm256_setzero_ps();
  __m256 floor = _mm256_set1_ps(-inf);  // the span's k-th largest so far (-inf until k are kept)
  for (; i + 8 <= e; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    __m256 d = _mm256_max_ps(_mm256_sub_ps(v, vt), _mm256_set1_ps(-1e30f));  // -inf - top -> a finite d
    __m256 p = exp8(d);                                                      // 0 there
    acc = _mm256_add_ps(acc, p);
    mom = _mm256_fmadd_ps(p, d, mom);
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(v, floor, _CMP_GT_OQ));
    while (mask) {
      keep(s, k, x[i + __builtin_ctz(mask)]);
      mask &= mask - 1;
    }
    if (s.count == k) floor = _mm256_set1_ps(s.largest[k - 1]);
  }
  sum = hsum(acc), moment = hsum(mom);
#endif
  for (; i < e; ++i) {
    if (x[i] == -inf) continue;
    const double d = static_cast<double>(x[i]) - top, p = std::exp(d);
    sum += p, moment += p * d;
    keep(s, k, x[i]);
  }
  s.sum = sum, s.moment = moment;
}

// the spans of one row -> out[0 .. 2 + k)
void combine(const Span* spans, int64_t n, int64_t k, double* out) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  float top = -std::numeric_limits<float>::infinity();
  bool bad = false;
  for (int64_t t = 0; t < n; ++t) bad |= spans[t].bad, top = std::max(top, spans[t].top);
  if (bad || std::isinf(top)) {
    std::fill(out, out + 2 + k, nan);
    return;
  }
  double sum = 0.0, moment = 0.0;  // about the row's maximum: sum exp(x - top), sum exp(x - top) (x - top)
  std::vector<float> largest;
  for (int64_t t = 0; t < n; ++t) {
    const Span& s = spans[t];
    if (s.top == -std::numeric_limits<float>::infinity()) continue;
    const double shift = static_cast<double>(s.top) - top, scale = std::exp(shift);
    sum += s.sum * scale;
    moment += (s.moment + s.sum * shift) * scale;
    largest.insert(largest.end(), s.largest, s.largest + s.count);
  }
  std::sort(largest.begin(), largest.end(), [](float a, float b) { return a > b; });
  const double log_sum = std::log(sum);
  out[0] = top + log_sum;
  out[1] = log_sum - moment / sum;  // -sum p log p, p = exp(x - top) / sum
  for (int64_t j = 0; j < k; ++j)
    out[2 + j] = j < static_cast<int64_t>(largest.size()) ? std::exp(static_cast<double>(largest[j]) - top) / sum : 0.0;
}

}  // namespace

torch::Tensor softmax_stats(torch::Tensor rows, int64_t k) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == torch::kFloat32 && rows.is_contiguous() && rows.size(1) > 0,
              "contiguous float32 rows (M, V), V > 0");
  TORCH_CHECK(k >= 1 && k <= kMaxK && k <= rows.size(1), "1 <= k <= min(16, V)");
  const int64_t M = rows.size(0), V = rows.size(1);
  const int64_t T = std::max<int64_t>(1, at::get_num_threads());
  std::vector<Span> spans(static_cast<size_t>(M * T));  // spans[m * T + t]: thread t's columns of row m
  std::vector<int64_t> starts(static_cast<size_t>(T), -1);
  const float* x = rows.data_ptr<float>();
  at::parallel_for(0, V, kGrain, [&](int64_t b, int64_t e) {
    const int64_t t = std::min<int64_t>(at::get_thread_num(), T - 1);
    starts[t] = b;
    for (int64_t m = 0; m < M; ++m) scan(x + m * V, b, e, k, spans[m * T + t]);
  });
  std::vector<int64_t> ran;  // threads that ran (the order of spans does not change the sums' meaning)
  for (int64_t t = 0; t < T; ++t)
    if (starts[t] >= 0) ran.push_back(t);
  std::sort(ran.begin(), ran.end(), [&](int64_t a, int64_t b) { return starts[a] < starts[b]; });
  auto out = torch::empty({M, 2 + k}, rows.options().dtype(torch::kFloat64));
  double* o = out.data_ptr<double>();
  std::vector<Span> row(ran.size());
  for (int64_t m = 0; m < M; ++m) {
    for (size_t j = 0; j < ran.size(); ++j) row[j] = spans[m * T + ran[j]];
    combine(row.data(), static_cast<int64_t>(row.size()), k, o + m * (2 + k));
  }
  return out;
}

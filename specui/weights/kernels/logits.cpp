// What a greedy step reads of the target's logits, in one pass over them on every thread:
//   row_stats(rows (M, V) float32, lse) -> (M, 3) float64, row m: [best, lse, top]
//   best = the first index of row m's maximum (the first NaN where the row has one: numpy's and
//          torch's argmax), lse = log(sum_v exp(rows[m, v])) as torch.logsumexp gives it (NaN where
//          the row has a NaN, +inf where it has a +inf, -inf where every entry is -inf), computed only
//          with `lse` (else NaN), top = rows[m, best] (the logit a greedy step's probability reads).
//   One float64 tensor, so the caller reads everything with one `tolist()` (indices are exact there).
// Why a kernel: the logits were just written by the output head's threads, each its own half of the
// columns (q8a8.cpp, torch's products alike), so a single thread reading a row pays for every line
// held by the other core: the first argmax over a 49k-entry row after a compiled w4a8 forward took
// 102 us against 14 us warm, a softmax 109 against 80 (2-core Zen 3). Here each thread scans the
// same half of the columns of every row, as the head split them, and the halves are combined. The
// maximum comes from one pass, the exponentials and the maximum's first index from a second.
#include "tensor.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "vexp.h"  // and <immintrin.h>, where AVX2 and FMA are there

namespace {

constexpr int64_t kGrain = 4096;  // columns a thread takes at least (a row's split follows the head's)

struct Part {
  float top = -std::numeric_limits<float>::infinity();  // this part's maximum
  int64_t best = -1;                                     // its first index (-1: the part is empty)
  int64_t nan = -1;                                      // its first NaN (-1: none)
  double sum = 0.0;                                      // sum of exp(x - top) over the part
};

#if defined(__AVX2__) && defined(__FMA__)
using specui_vec::exp8;  // vexp.h: exp(x - top) of 8 entries, x - top <= 0
using specui_vec::hmax8;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
#endif

// columns [b, e) of one row
void scan(const float* x, int64_t b, int64_t e, bool with_sum, Part& part) {
  if (b >= e) return;
  int64_t i = b;
  float top = -std::numeric_limits<float>::infinity();
  bool nan = false;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 vtop = _mm256_set1_ps(top), vnan = _mm256_setzero_ps();
  for (; i + 8 <= e; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    vtop = _mm256_max_ps(vtop, v);
  }
  top = hmax8(vtop);
  nan = _mm256_movemask_ps(vnan) != 0;
#endif
  for (; i < e; ++i) {
    nan |= std::isnan(x[i]);
    top = std::max(top, x[i]);
  }
  if (nan) {
    for (i = b; !std::isnan(x[i]); ++i) {}
    part.nan = i;
    return;
  }
  part.top = top;
  int64_t best = -1;
  i = b;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 vt = _mm256_set1_ps(top);
#endif
  if (!with_sum || std::isinf(top)) {  // all -inf: no terms; +inf: the row's lse is +inf
#if defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= e; i += 8) {
      int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vt, _CMP_EQ_OQ));
      if (mask) {
        i += __builtin_ctz(mask);
        break;
      }
    }
#endif
    while (x[i] != top) ++i;  // present: top is one of the part's entries
    part.best = i;
    return;
  }
  // the exponentials, the first index of the maximum found on the way (no pass of its own)
  double sum = 0.0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= e; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(v, vt)));
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(v, vt, _CMP_EQ_OQ));
    if (mask) {
      best = i + __builtin_ctz(mask);
      i += 8;
      break;
    }
  }
  for (; i + 8 <= e; i += 8) acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vt)));
  sum = hsum(acc);
#endif
  for (; i < e; ++i) {
    if (best < 0 && x[i] == top) best = i;
    sum += std::exp(static_cast<double>(x[i]) - top);
  }
  part.best = best;  // present: top is one of the part's entries
  part.sum = sum;
}

// the parts of one row, in column order -> (best, lse, top)
std::tuple<int64_t, double, double> combine(const Part* parts, int64_t n, bool with_sum) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (int64_t t = 0; t < n; ++t)
    if (parts[t].nan >= 0) return {parts[t].nan, nan, nan};
  int64_t best = -1;
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t)
    if (parts[t].best >= 0 && (best < 0 || parts[t].top > top)) best = parts[t].best, top = parts[t].top;
  if (!with_sum) return {best, nan, top};
  if (std::isinf(top)) return {best, static_cast<double>(top), top};  // torch's logsumexp: +inf, or -inf (all masked)
  double sum = 0.0;
  for (int64_t t = 0; t < n; ++t)
    if (parts[t].best >= 0 && !std::isinf(parts[t].top))
      sum += parts[t].sum * std::exp(static_cast<double>(parts[t].top) - top);
  return {best, top + std::log(sum), top};
}

}  // namespace

torch::Tensor row_stats(torch::Tensor rows, bool lse) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == torch::kFloat32 && rows.is_contiguous() && rows.size(1) > 0,
              "contiguous float32 rows (M, V), V > 0");
  const int64_t M = rows.size(0), V = rows.size(1);
  const int64_t T = std::max<int64_t>(1, at::get_num_threads());
  std::vector<Part> parts(static_cast<size_t>(M * T));  // parts[m * T + t]: thread t's columns of row m
  const float* x = rows.data_ptr<float>();
  // one region: each thread its own span of columns in every row (at::parallel_for gives thread t the
  // t-th contiguous chunk; the chunk's start orders the parts)
  std::vector<int64_t> starts(static_cast<size_t>(T), -1);
  at::parallel_for(0, V, kGrain, [&](int64_t b, int64_t e) {
    const int64_t t = std::min<int64_t>(at::get_thread_num(), T - 1);
    starts[t] = b;
    for (int64_t m = 0; m < M; ++m) scan(x + m * V, b, e, lse, parts[m * T + t]);
  });
  std::vector<int64_t> order;  // threads that ran, by their chunk's start
  for (int64_t t = 0; t < T; ++t)
    if (starts[t] >= 0) order.push_back(t);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return starts[a] < starts[b]; });
  auto out = torch::empty({M, 3}, rows.options().dtype(torch::kFloat64));
  double* o = out.data_ptr<double>();
  std::vector<Part> row(order.size());
  for (int64_t m = 0; m < M; ++m) {
    for (size_t k = 0; k < order.size(); ++k) row[k] = parts[m * T + order[k]];
    auto [b, s, t] = combine(row.data(), static_cast<int64_t>(row.size()), lse);
    o[3 * m] = static_cast<double>(b), o[3 * m + 1] = s, o[3 * m + 2] = t;
  }
  return out;
}

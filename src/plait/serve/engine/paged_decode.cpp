// Paged decode attention on a CPU: every decoding sequence's one query against its keys and values where they lie
// in the pool (plait.serve.engine.kernels loads it; plait.serve.engine.paged calls it). The plain-torch path
// gathers each sequence's blocks into a padded batch first and then attends it, so the keys and values cross
// memory three times (read, written, read again) and the padding is attended; here they are read once, through
// the block table, with no padding.
//
// q        (n, heads, d)            one query per sequence, float32, contiguous
// k_pool   (kv_heads, slots, d)     a layer's keys, float32, contiguous (slot = block * block_size + offset)
// v_pool   (kv_heads, slots, d)     its values
// tables   (n, width) int64         each sequence's block table, padded
// first    (n,) int64               each sequence's first attended position (a sliding window's start, else 0)
// stop     (n,) int64               its number of keys (positions first .. stop - 1 are attended)
// returns  (n, heads, d)            softmax(q k^T * scale) v per sequence and query head; the query heads
//                                   h * group .. h * group + group - 1 share key head h (grouped-query attention)
//
// One task per (sequence, key head): its group of query heads' scores over the keys (one pass over the keys),
// the softmax in float (max subtracted), then one pass over the values.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t d) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < d; ++i) acc += a[i] * b[i];
  return acc;
}

inline void axpy(float w, const float* x, float* y, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) y[i] += w * x[i];
}

}  // namespace

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor tables,
                           torch::Tensor first, torch::Tensor stop, int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.sizes() == k_pool.sizes(), "paged_decode: shapes");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_pool.scalar_type() == at::kFloat, "paged_decode: float32 only");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() && tables.is_contiguous(),
              "paged_decode: contiguous tensors only");
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = k_pool.size(0), slots = k_pool.size(1), width = tables.size(1);
  TORCH_CHECK(k_pool.size(2) == d && heads % kv_heads == 0, "paged_decode: head sizes");
  const int64_t group = heads / kv_heads;
  auto out = torch::zeros_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_pool.data_ptr<float>();
  const float* vp = v_pool.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* fp = first.data_ptr<int64_t>();
  const int64_t* sp = stop.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // Every sequence's range and slots checked first: nothing may throw inside the parallel loop.
  for (int64_t s = 0; s < n; ++s) {
    const int64_t lo = fp[s], hi = sp[s];
    TORCH_CHECK(0 <= lo && lo < hi && (hi - 1) / block_size < width, "paged_decode: sequence ", s, " keys ", lo,
                "..", hi, " outside its block table");
    for (int64_t b = lo / block_size; b <= (hi - 1) / block_size; ++b) {
      const int64_t block = tp[s * width + b];
      TORCH_CHECK(0 <= block && (block + 1) * block_size <= slots, "paged_decode: sequence ", s, " block ", block,
                  " outside the pool");
    }
  }
  // OpenMP directly, on the calling thread's torch thread count (at::get_num_threads: the engine thread's own).
  // ATen's parallel_for, inlined here, would first run this library's own copy of its once-per-thread set-up, which
  // sets the thread's count to whatever set_num_threads any thread called last (the server's other threads set 1):
  // behind `plait serve` the whole engine then ran on one thread. Dynamic scheduling: sequences differ in length.
  const int64_t tasks = n * kv_heads;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks)));
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t s = task / kv_heads, h = task % kv_heads;
      const int64_t lo = fp[s], hi = sp[s], keys = hi - lo;
      scores.assign(static_cast<size_t>(group * keys), 0.f);
      const float* qs = qp + (s * heads + h * group) * d;
      const int64_t* table = tp + s * width;
      for (int64_t p = lo; p < hi; ++p) {
        const int64_t slot = table[p / block_size] * block_size + p % block_size;
        const float* key = kp + (h * slots + slot) * d;
        for (int64_t g = 0; g < group; ++g) scores[g * keys + (p - lo)] = dot(qs + g * d, key, d) * sc;
      }
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores.data() + g * keys;
        const float top = *std::max_element(row, row + keys);
        float total = 0.f;
        for (int64_t j = 0; j < keys; ++j) total += (row[j] = std::exp(row[j] - top));
        const float inv = 1.f / total;
        for (int64_t j = 0; j < keys; ++j) row[j] *= inv;
      }
      float* os = op + (s * heads + h * group) * d;
      for (int64_t p = lo; p < hi; ++p) {
        const int64_t slot = table[p / block_size] * block_size + p % block_size;
        const float* value = vp + (h * slots + slot) * d;
        for (int64_t g = 0; g < group; ++g) axpy(scores[g * keys + (p - lo)], value, os + g * d, d);
      }
    }
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // without the GIL, as torch's own ops run: the server's event loop streams tokens meanwhile (holding it, the
  // kernel doubled the served TTFT and ITL p99)
  m.def("paged_decode", &paged_decode, "paged decode attention: q (n, heads, d) against each sequence's blocks",
        py::call_guard<py::gil_scoped_release>());
}

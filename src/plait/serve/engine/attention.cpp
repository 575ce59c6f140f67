// plait's CPU attention kernels (plait.serve.engine.kernels builds and loads them; plait.serve.engine.paged calls
// them): paged decode attention, and flash attention for prompt chunks.
//
// paged_decode: every decoding sequence's one query against its keys and values where they lie in the pool. The
// plain-torch path gathers each sequence's blocks into a padded batch first and then attends it, so the keys and
// values cross memory three times (read, written, read again) and the padding is attended; here they are read
// once, through the block table, with no padding.
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
// One task per (sequence, key head): one pass over its blocks, keys and values together (two streams from memory at
// once: a pass over all the keys and then one over the values read 27-29 GB/s here): a block's scores for the group
// of query heads, the online softmax (the sums so far rescaled when the maximum grows; a vectorised exp), then the
// block's values into the outputs. No division per key.
//
// flash_attention: a prompt chunk's queries against keys and values (its own, causally, or earlier ones read where
// they lie in the pool, all seen), FlashAttention's online softmax in blocks of keys; returns the output and each
// query's log-sum-exp, so that attentions over disjoint sets of keys merge (plait.serve.engine.paged._merged).
// See flash_attention below.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

// The widest vectors the machine has, and the micro tile that fits its registers: AVX-512, 32 registers of 16
// floats: 6 queries x 4 vectors of scores, then of outputs; AVX2 (and narrower), 16 registers: 3 x 4.
#if defined(__AVX512F__)
constexpr int VL = 16;
constexpr int R = 6;
#elif defined(__AVX__)
constexpr int VL = 8;
constexpr int R = 3;
#else
constexpr int VL = 4;
constexpr int R = 3;
#endif
typedef float vec __attribute__((vector_size(VL * 4)));
typedef int32_t ivec __attribute__((vector_size(VL * 4)));

constexpr int BN = 4 * VL;  // keys per block: 4 vectors
constexpr int BM = 8 * R;   // queries per task

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof v); }
template <size_t... I>
inline vec splat(float x, std::index_sequence<I...>) {
  return vec{((void)I, x)...};  // a braced list, which GCC makes one broadcast (a loop of stores it does not)
}
inline vec splat(float x) { return splat(x, std::make_index_sequence<VL>{}); }

#if defined(__AVX512F__)
inline float hmax(vec v) { return _mm512_reduce_max_ps(reinterpret_cast<__m512>(v)); }
inline float hsum(vec v) { return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v)); }
#else
inline float hmax(vec v) {
  float m = v[0];
  for (int i = 1; i < VL; ++i) m = std::max(m, v[i]);
  return m;
}
inline float hsum(vec v) {
  float s = 0.f;
  for (int i = 0; i < VL; ++i) s += v[i];
  return s;
}
#endif

// e^x for x <= 0 (a softmax's shifted scores), 1e-7 relative: 2^n e^r, |r| <= ln2 / 2, r's Taylor series to r^6.
inline vec vexp(vec x) {
  const vec lo = splat(-87.0f);
  x = x < lo ? lo : x;
  const vec magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer in the low mantissa bits
  vec t = x * splat(1.44269504088896341f) + magic;
  vec n = t - magic;
  vec r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
  vec p = splat(1.f / 720) * r + splat(1.f / 120);
  p = p * r + splat(1.f / 24);
  p = p * r + splat(1.f / 6);
  p = p * r + splat(0.5f);
  p = p * r + splat(1.f);
  p = p * r + splat(1.f);
  ivec ti, mi, pi;
  std::memcpy(&ti, &t, sizeof t);
  std::memcpy(&mi, &magic, sizeof magic);
  std::memcpy(&pi, &p, sizeof p);
  pi += (ti - mi) << 23;
  vec out;
  std::memcpy(&out, &pi, sizeof out);
  return out;
}

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
    std::vector<float> scores, top(static_cast<size_t>(group)), total(static_cast<size_t>(group));
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t s = task / kv_heads, h = task % kv_heads;
      const int64_t lo = fp[s], hi = sp[s];
      scores.resize(static_cast<size_t>(group * block_size));
      const float* qs = qp + (s * heads + h * group) * d;
      const int64_t* table = tp + s * width;
      float* os = op + (s * heads + h * group) * d;  // zeros: the running sums of each query head's output
      std::fill(top.begin(), top.end(), -std::numeric_limits<float>::infinity());
      std::fill(total.begin(), total.end(), 0.f);
      // block by block: position p of block b lies at row table[b] * block_size + p - b * block_size of the pool
      for (int64_t b = lo / block_size; b * block_size < hi; ++b) {
        const int64_t p0 = std::max(lo, b * block_size), p1 = std::min(hi, (b + 1) * block_size), n = p1 - p0;
        const int64_t at = h * slots + (table[b] - b) * block_size;  // + p: the row of position p
        for (int64_t p = p0; p < p1; ++p)
          for (int64_t g = 0; g < group; ++g)
            scores[g * block_size + (p - p0)] = dot(qs + g * d, kp + (at + p) * d, d) * sc;
        for (int64_t g = 0; g < group; ++g) {
          float* row = scores.data() + g * block_size;
          float high = top[g];
          for (int64_t j = 0; j < n; ++j) high = std::max(high, row[j]);
          const float alpha = std::exp(top[g] - high);  // the sums so far, rescaled to the new maximum (0 at first)
          float sum = 0.f;
          int64_t j = 0;
          if (n >= VL) {
            const vec hv = splat(high);
            vec vs = vec{};
            for (; j + VL <= n; j += VL) {
              const vec e = vexp(load(row + j) - hv);
              store(row + j, e);
              vs += e;
            }
            sum = hsum(vs);
          }
          for (; j < n; ++j) sum += (row[j] = std::exp(row[j] - high));
          total[g] = total[g] * alpha + sum;
          top[g] = high;
          if (alpha != 1.f)
            for (int64_t i = 0; i < d; ++i) os[g * d + i] *= alpha;
        }
        for (int64_t p = p0; p < p1; ++p)
          for (int64_t g = 0; g < group; ++g)
            axpy(scores[g * block_size + (p - p0)], vp + (at + p) * d, os + g * d, d);
      }
      for (int64_t g = 0; g < group; ++g) {
        const float inv = 1.f / total[g];
        for (int64_t i = 0; i < d; ++i) os[g * d + i] *= inv;
      }
    }
  }
  return out;
}

// ---- flash attention
//
// q        (heads, m, d)            the chunk's queries, float32, each row contiguous (any other strides)
// k, v     (kv_heads, n, d)         the keys and values it attends, the same
// causal                            query i sees keys 0 .. i + n - m (its own position and before), else all n
// returns  out (heads, m, d), lse (heads, m): softmax(q k^T * scale) v and each row's log-sum-exp of the scaled
//          scores; query head h attends key head h / (heads / kv_heads) (grouped-query attention)
//
// ATen's CPU flash attention (what SDPA runs here) multiplies its blocks with MKL's sgemm, which takes its AVX2 path
// on an AMD processor; vLLM has its own AVX-512 CPU kernel. Here: each key head's keys transposed once per call into
// blocks of BN (kt, d x BN each), then one task per query head and BM queries (the longest first: causal rows see
// more keys), its key blocks in order, and in each, micro tiles of R queries: their R x BN scores in registers (one
// key row of kt loaded per dimension, each query's element broadcast), the online softmax (a vectorised exp; the
// running output rescaled by exp(old max - new max)), then P V into R x 4 vectors of output columns in registers.
// GCC vector extensions, as wide as the machine's registers (-march=native). On a 2-core AMD EPYC with AVX-512 a
// causal 2048-token chunk of 4 heads of 64 takes 6.1 ms against SDPA's 14.0 (about 350 against 150 GFLOP/s); built
// for AVX2 on the same machine, 15.6 ms (kernels.FLASH_MIN_VECTOR keeps SDPA's there).

namespace {

// D: head width; CW: vectors of output columns in registers at once (4; D / VL when narrower)
template <int D>
void flash_impl(const float* qp, int64_t qs0, int64_t qs1, const float* kp, int64_t ks0, int64_t ks1,
                const float* vp, int64_t vs0, int64_t vs1, float* op, float* lp, int64_t H, int64_t Hk, int64_t M,
                int64_t N, bool causal, float scale, int threads) {
  constexpr int CW = D < 4 * VL ? D / VL : 4;
  static_assert(D % (CW * VL) == 0, "head width: whole vectors of output columns");
  const int64_t group = H / Hk;
  const int64_t nblk = (N + BN - 1) / BN;
  // keys transposed, block by block: kt[h][b][c][j] = k[h][b * BN + j][c] (0 past the last key)
  std::vector<float> kt(static_cast<size_t>(Hk * nblk * D * BN));
  const int64_t off = N - M;  // causal: query i sees keys 0 .. i + off
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t hb = 0; hb < Hk * nblk; ++hb) {
      const int64_t h = hb / nblk, b = hb % nblk;
      float* dst = kt.data() + hb * D * BN;
      const int64_t n = std::min<int64_t>(BN, N - b * BN);
      for (int64_t j = 0; j < BN; ++j) {
        if (j < n) {
          const float* src = kp + h * ks0 + (b * BN + j) * ks1;
          for (int c = 0; c < D; ++c) dst[c * BN + j] = src[c];
        } else {
          for (int c = 0; c < D; ++c) dst[c * BN + j] = 0.f;
        }
      }
    }
    std::vector<float> O(BM * D), P(R * BN);
    float m[BM], l[BM];
    const int64_t qblocks = (M + BM - 1) / BM;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < H * qblocks; ++task) {
      const int64_t h = task % H, qb = qblocks - 1 - task / H;  // the longest (causal) first
      const int64_t hk = h / group;
      const int64_t i0 = qb * BM, rows = std::min<int64_t>(BM, M - i0);
      std::fill(O.begin(), O.end(), 0.f);
      std::fill(m, m + BM, -std::numeric_limits<float>::infinity());
      std::fill(l, l + BM, 0.f);
      const int64_t last_key = causal ? std::min<int64_t>(N - 1, i0 + rows - 1 + off) : N - 1;
      for (int64_t b = 0; b <= last_key / BN; ++b) {
        const int64_t j0 = b * BN;
        const float* ktb = kt.data() + (hk * nblk + b) * D * BN;
        for (int64_t t0 = 0; t0 < rows; t0 += R) {
          const float* q[R];
          int64_t lim[R];  // the last key index (within the block) row r may see
          for (int r = 0; r < R; ++r) {
            const int64_t i = i0 + std::min<int64_t>(t0 + r, rows - 1);
            q[r] = qp + h * qs0 + i * qs1;
            lim[r] = (causal ? std::min<int64_t>(i + off, N - 1) : N - 1) - j0;
          }
          if (lim[R - 1] < 0) continue;  // (causal) nothing here for any row of the tile: later rows see more
          vec s[R][4];
          for (int r = 0; r < R; ++r)
            for (int x = 0; x < 4; ++x) s[r][x] = vec{};
          for (int c = 0; c < D; ++c) {
            const vec k0 = load(ktb + c * BN), k1 = load(ktb + c * BN + VL), k2 = load(ktb + c * BN + 2 * VL),
                      k3 = load(ktb + c * BN + 3 * VL);
            for (int r = 0; r < R; ++r) {
              const vec qb = splat(q[r][c]);
              s[r][0] += qb * k0;
              s[r][1] += qb * k1;
              s[r][2] += qb * k2;
              s[r][3] += qb * k3;
            }
          }
          float alpha[R];
          vec iota;
          for (int i = 0; i < VL; ++i) iota[i] = static_cast<float>(i);
          const vec ninf = splat(-std::numeric_limits<float>::infinity());
          for (int r = 0; r < R; ++r) {
            const int64_t at = t0 + r;
            for (int x = 0; x < 4; ++x) {
              s[r][x] *= splat(scale);
              if (lim[r] < BN - 1)
                s[r][x] = iota + splat(static_cast<float>(VL * x)) > splat(static_cast<float>(lim[r])) ? ninf : s[r][x];
            }
            vec top = s[r][0];
            for (int x = 1; x < 4; ++x) top = top > s[r][x] ? top : s[r][x];
            const float old = at < rows ? m[at] : 0.f;
            float mnew = std::max(old, hmax(top));
            if (lim[r] < 0) mnew = old;
            const vec mv = splat(mnew);
            vec sum = vec{};
            for (int x = 0; x < 4; ++x) {
              vec p = vexp(s[r][x] - mv);
              p = s[r][x] == ninf ? vec{} : p;
              sum += p;
              store(P.data() + r * BN + VL * x, p);
            }
            alpha[r] = std::exp(old - mnew);
            if (at < rows) {
              m[at] = mnew;
              l[at] = l[at] * alpha[r] + hsum(sum);
            }
          }
          const int64_t keys = std::min<int64_t>(BN, N - j0);
          for (int c0 = 0; c0 < D; c0 += VL * CW) {
            vec o[R][CW];
            for (int r = 0; r < R; ++r)
              for (int x = 0; x < CW; ++x)
                o[r][x] = t0 + r < rows ? load(O.data() + (t0 + r) * D + c0 + VL * x) * splat(alpha[r]) : vec{};
            for (int64_t j = 0; j < keys; ++j) {
              const float* vr = vp + hk * vs0 + (j0 + j) * vs1 + c0;
              vec vv[CW];
              for (int x = 0; x < CW; ++x) vv[x] = load(vr + VL * x);
              for (int r = 0; r < R; ++r) {
                const vec pb = splat(P[r * BN + j]);
                for (int x = 0; x < CW; ++x) o[r][x] += pb * vv[x];
              }
            }
            for (int r = 0; r < R; ++r)
              if (t0 + r < rows)
                for (int x = 0; x < CW; ++x) store(O.data() + (t0 + r) * D + c0 + VL * x, o[r][x]);
          }
        }
      }
      for (int64_t t = 0; t < rows; ++t) {
        const float inv = 1.f / l[t];
        float* dst = op + (h * M + i0 + t) * D;
        for (int c = 0; c < D; ++c) dst[c] = O[t * D + c] * inv;
        lp[h * M + i0 + t] = m[t] + std::log(l[t]);
      }
    }
  }
}

}  // namespace

std::vector<torch::Tensor> flash_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool causal,
                                           double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "flash_attention: shapes");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "flash_attention: float32 only");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "flash_attention: rows must be contiguous");
  const int64_t H = q.size(0), M = q.size(1), D = q.size(2), Hk = k.size(0), N = k.size(1);
  TORCH_CHECK(k.size(2) == D && H % Hk == 0 && N >= 1 && M >= 1, "flash_attention: head sizes");
  TORCH_CHECK(!causal || N >= M, "flash_attention: causal needs at least as many keys as queries");
  auto out = torch::empty({H, M, D}, q.options());
  auto lse = torch::empty({H, M}, q.options());
  const int threads = std::max(1, at::get_num_threads());
  const float sc = static_cast<float>(scale);
#define CALL(DD)                                                                                                     \
  flash_impl<DD>(q.data_ptr<float>(), q.stride(0), q.stride(1), k.data_ptr<float>(), k.stride(0), k.stride(1),     \
                 v.data_ptr<float>(), v.stride(0), v.stride(1), out.data_ptr<float>(), lse.data_ptr<float>(), H, Hk, \
                 M, N, causal, sc, threads)
  if (D == 64)
    CALL(64);
  else if (D == 128)
    CALL(128);
  else if (D == 32)
    CALL(32);
  else
    TORCH_CHECK(false, "flash_attention: head width ", D, " (32, 64 or 128 only)");
#undef CALL
  return {out, lse};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // without the GIL, as torch's own ops run: the server's event loop streams tokens meanwhile (holding it, the
  // kernel doubled the served TTFT and ITL p99)
  m.def("paged_decode", &paged_decode, "paged decode attention: q (n, heads, d) against each sequence's blocks",
        py::call_guard<py::gil_scoped_release>());
  m.def("flash_attention", &flash_attention,
        "flash attention: q (heads, m, d) against k, v (kv_heads, n, d), causal or not -> (out, log-sum-exp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("vector_width", [] { return VL; }, "floats per vector register in flash_attention (16: AVX-512)");
}

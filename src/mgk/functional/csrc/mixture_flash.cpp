// Fused CPU kernel for MGK: the component weights are summed before the value product (mixture="sum"), or the
// best component is taken (mixture="max", Hard-E: s_ij = max_r s_ijr, with bias_jr = -|k_jr|^2 / (2 sigma_r^2)).
//
// For each (batch*head) slice, query i, key position j and mixture component r, the score is
//
//     s_ijr = q_i . k_jr + bias_jr + rowbias_ir        (rowbias only when the variances differ)
//
// with k_jr already divided by sigma_r^2 and bias_jr = log pi_jr - |k_jr|^2 / (2 sigma_r^2). The attention weight of
// key j is A_ij = sum_r exp(s_ijr - LSE_i) with LSE_i = logsumexp_{j,r} s_ijr, and out_i = sum_j A_ij v_j. The
// mixture's logsumexp over r and the softmax over j are the same log-sum-exp, so one online (flash) pass over key
// blocks computes it. Per key block: M score GEMMs, then ONE value GEMM on the summed weights (softmax attention
// over the M*S concatenated keys would do M value GEMMs). Backward: M score GEMMs (recompute), one dV GEMM on the
// summed weights, one dP GEMM, and M GEMMs each for dQ and dK -- 3M + 2 against 5M for M flash backward passes.
//
// Memory is O(block) per thread; nothing of size L x S is stored. Causal masking is aligned bottom-right
// (key j is visible from query i when j <= i + S - L); key blocks entirely above the diagonal are skipped.
// BLAS is the sgemm_/dgemm_ that libtorch_cpu exports (MKL in the official CPU wheels). Hard-E runs the same
// GEMMs; its backward sends each score's gradient to the maximising components, split evenly between ties.
// Attention dropout (see struct Dropout) multiplies A_ij by keep_ij / (1 - p) before the value GEMM; LSE_i is the
// un-dropped statistic, so out_i = sum_j A_ij keep_ij / (1 - p) v_j, as dropout on softmax weights.
//
// Grouped keys (gMGK, GQA's grouping): the keys, values and per-key bias have G heads (key groups), the queries H, a
// multiple of G; query head h reads group h / (H / G) in place, nothing expanded. Shifted keys (sMGK, k_jr = k_j -
// mu_r): the keys hold one unscaled component (Mk = 1) and scale_r = 1 / sigma_r^2 per group, and the score is
// s_ijr = scale_r (q_i . k_j) + bias_jr + rowbias_ir (the shifts' per-query term rides in rowbias), so a block takes
// ONE score GEMM for the M components, and backward one dK and one dQ GEMM on sum_r scale_r dS_r (plus the scale's
// gradient, sum_ij dS_ijr (q_i . k_j)): 5 GEMMs a block instead of 3M + 2.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <algorithm>
#include <memory>
#include <mutex>
#include <vector>

extern "C" {
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*, const int*,
            const float*, const int*, const float*, float*, const int*);
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*, const double*, const int*,
            const double*, const int*, const double*, double*, const int*);
// MKL (in the official CPU wheels) would start its own threads inside our parallel region; weak, so that a build
// against another BLAS still loads.
int MKL_Set_Num_Threads_Local(int) __attribute__((weak));
}

namespace {

// Keeps BLAS single-threaded on this thread for the lifetime of the guard (we parallelise over blocks).
struct SerialBlas {
  int previous = 0;
  SerialBlas() { if (MKL_Set_Num_Threads_Local) previous = MKL_Set_Num_Threads_Local(1); }
  ~SerialBlas() { if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(previous); }
};

template <typename T>
using V = at::vec::Vectorized<T>;

// Row-major C (m x n) = alpha * op(A) op(B) + beta * C, through column-major BLAS (C^T = op(B)^T op(A)^T).
inline void gemm(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, int lda, const float* b,
                 int ldb, float beta, float* c, int ldc) {
  const char tA = ta ? 'T' : 'N', tB = tb ? 'T' : 'N';
  sgemm_(&tB, &tA, &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
}
inline void gemm(bool ta, bool tb, int m, int n, int k, double alpha, const double* a, int lda, const double* b,
                 int ldb, double beta, double* c, int ldc) {
  const char tA = ta ? 'T' : 'N', tB = tb ? 'T' : 'N';
  dgemm_(&tB, &tA, &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
}

template <typename T>
inline V<T> vexp(const V<T>& x) { return x.exp(); }
template <>
inline V<float> vexp<float>(const V<float>& x) { return x.exp_u20(); }

// y[j] = exp(x[j] - m) (or y[j] += exp(x[j] - m) when accumulate) for j < n; x and y may alias.
template <typename T>
inline void exp_shift(const T* x, T m, T* y, int n, bool accumulate) {
  const int W = V<T>::size();
  const V<T> vm(m);
  int j = 0;
  if (accumulate) {
    for (; j + W <= n; j += W) (vexp<T>(V<T>::loadu(x + j) - vm) + V<T>::loadu(y + j)).store(y + j);
    for (; j < n; ++j) y[j] += std::exp(x[j] - m);
  } else {
    for (; j + W <= n; j += W) vexp<T>(V<T>::loadu(x + j) - vm).store(y + j);
    for (; j < n; ++j) y[j] = std::exp(x[j] - m);
  }
}

// ds[j] *= t[j] for j < n; adds ds to colsum and returns the row sum.
template <typename T>
inline T mul_colsum_rowsum(T* ds, const T* t, T* colsum, int n) {
  const int W = V<T>::size();
  V<T> acc(T(0));
  int j = 0;
  for (; j + W <= n; j += W) {
    V<T> d = V<T>::loadu(ds + j) * V<T>::loadu(t + j);
    d.store(ds + j);
    (V<T>::loadu(colsum + j) + d).store(colsum + j);
    acc = acc + d;
  }
  T rs = at::vec::vec_reduce_all<T>([](const V<T>& a, const V<T>& b) { return a + b; }, acc);
  for (; j < n; ++j) {
    ds[j] *= t[j];
    colsum[j] += ds[j];
    rs += ds[j];
  }
  return rs;
}

// Per-thread scratch that survives between calls: block buffers are ~1 MB, and fresh allocations of that size
// come from mmap and page-fault on every call.
template <typename T>
T* scratch(int slot, size_t n) {
  thread_local std::vector<T> buffers[8];
  auto& b = buffers[slot];
  if (b.size() < n) b.resize(n);
  return b.data();
}

template <typename T>
struct Shapes {
  int64_t BH, M, L, S, D, Dv;
  bool causal, hard;
  int64_t H = 1, R = 1;  // query heads of a slice's batch row (1 for (BH, ...) layouts), and per key group
  int64_t Mk = 0;        // key components held: M, or 1 with scale (shifted keys); 0 read as M
  const T* scale = nullptr;  // (BG, M): scale_r of each key group's slice, or nullptr (keys already scaled)
  // The key group slice (of keys, values and the per-key bias) that query slice bh reads.
  int64_t kv(int64_t bh) const { return R == 1 ? bh : (bh / H) * (H / R) + (bh % H) / R; }
  int64_t comps() const { return Mk == 0 ? M : Mk; }
};

// The rows of a (B, H, rows, cols) or (BH, rows, cols) tensor, and of keys (B, H, M, rows, cols) or
// (BH, M, rows, cols), by (batch*head) slice bh, component r and row: any strides with a unit column stride and a
// row stride >= cols (BLAS's leading dimension). So the kernel reads q, k, v and writes out, dq, dk, dv in the
// layout the projections leave them, (B, L, H, D) seen as (B, H, L, D), instead of the caller copying them into
// (B, H, L, D) order and back (two copies per tensor and direction, a visible share at a few hundred tokens).
template <typename T>
struct Rows {
  T* base;
  int64_t H, sb, sh, sm, ld;
  T* at(int64_t bh, int64_t row, int64_t r = 0) const {
    return base + (bh / H) * sb + (bh % H) * sh + r * sm + row * ld;
  }
};

template <typename T>
Rows<T> rows_of(const torch::Tensor& t, bool components) {
  const int64_t lead = t.dim() - (components ? 3 : 2);  // 2: (B, H, ...); 1: (BH, ...)
  Rows<T> x;
  x.base = t.data_ptr<T>();
  x.H = lead == 2 ? t.size(1) : 1;
  x.sb = t.stride(0);
  x.sh = lead == 2 ? t.stride(1) : 0;
  x.sm = components ? t.stride(lead) : 0;
  x.ld = t.size(-2) > 1 ? t.stride(-2) : t.size(-1);  // one row: any leading dimension >= cols will do
  return x;
}

// Attention dropout on the mixed weight A_ij (after the sum over components), from a counter-based stream: the
// keep decision of (slice bh, query i, key j) is a hash of (seed, offset, bh, i, j) alone, so backward regenerates
// the forward's mask without storing it and the mask does not depend on blocking or on the thread count (the
// counter-based approach of Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011, which
// flash-attention uses with Philox). The row key mixes (seed, offset, bh, i) through SplitMix64 (Steele et al.,
// OOPSLA 2014); the key index goes through two rounds of MurmurHash3's 32-bit finaliser, which the compiler
// vectorises. Keep iff hash >= threshold = round(p * 2^32); kept weights are scaled by 1 / (1 - p).
struct Dropout {
  uint64_t seed = 0, offset = 0, threshold = 0;  // threshold 0: no dropout
  double scale = 1.0;
  bool on() const { return threshold > 0; }
};

inline Dropout make_dropout(double p, int64_t seed, int64_t offset) {
  Dropout d;
  TORCH_CHECK(p >= 0.0 && p <= 1.0, "dropout_p must be in [0, 1], got ", p);
  d.seed = static_cast<uint64_t>(seed);
  d.offset = static_cast<uint64_t>(offset);
  d.threshold = static_cast<uint64_t>(std::llround(p * 4294967296.0));
  d.scale = p < 1.0 ? 1.0 / (1.0 - p) : 0.0;
  return d;
}

inline uint64_t splitmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bU;
  h ^= h >> 13;
  h *= 0xc2b2ae35U;
  return h ^ (h >> 16);
}

inline uint64_t dropout_row_key(const Dropout& d, int64_t bh, int64_t L, int64_t i) {
  return splitmix64(d.seed ^ splitmix64(d.offset + static_cast<uint64_t>(bh * L + i) * 0x9e3779b97f4a7c15ULL));
}

// x[j] *= keep(row, j0 + j) ? scale : 0 for j < n (z = nullptr), or z[j] = that factor (x = nullptr).
template <typename T>
inline void dropout_row(uint64_t key, int64_t j0, int n, const Dropout& d, T* x, T* z) {
  const uint32_t lo = static_cast<uint32_t>(key), hi = static_cast<uint32_t>(key >> 32);
  const uint32_t base = static_cast<uint32_t>(j0);
  const T scale = static_cast<T>(d.scale);
  const uint64_t thr = d.threshold;
  if (x) {
    for (int j = 0; j < n; ++j) {
      const uint32_t h = fmix32(fmix32((base + static_cast<uint32_t>(j)) * 0x9e3779b9U ^ lo) ^ hi);
      x[j] = static_cast<uint64_t>(h) >= thr ? x[j] * scale : T(0);
    }
  } else {
    for (int j = 0; j < n; ++j) {
      const uint32_t h = fmix32(fmix32((base + static_cast<uint32_t>(j)) * 0x9e3779b9U ^ lo) ^ hi);
      z[j] = static_cast<uint64_t>(h) >= thr ? scale : T(0);
    }
  }
}

constexpr int kBlockQ = 128;
constexpr int kBlockK = 512;

// max that returns NaN when either side is NaN (std::max would drop it and hide a NaN score).
template <typename T>
inline T nanmax(T a, T b) { return (a > b || std::isnan(a)) ? a : b; }

// Rows (or keys) per task: the largest power-of-two fraction of the maximum block that still gives every thread
// a task (one head with few queries would otherwise run on one thread).
inline int64_t task_block(int64_t max_block, int64_t min_block, int64_t BH, int64_t n) {
  const int64_t threads = at::get_num_threads();
  int64_t b = max_block;
  while (b > min_block && BH * ((n + b - 1) / b) < threads) b /= 2;
  return b;
}

// Small problems run on the calling thread: waking the thread pool costs more than they do.
template <typename T>
inline int64_t grain_for(const Shapes<T>& sh, int64_t tasks) {
  return sh.BH * sh.L * sh.S * sh.M < (int64_t(1) << 18) ? std::max<int64_t>(tasks, 1) : 1;
}

// dst[i][j] = max_r src_r[i][j] over the M component blocks (stride blk), NaN-propagating; dst may be src_0.
template <typename T>
inline void max_over_components(const T* src, int64_t M, size_t blk, int bq, int bk, T* dst) {
  const int W = V<T>::size();
  for (int i = 0; i < bq; ++i) {
    const int64_t o = static_cast<int64_t>(i) * kBlockK;
    int j = 0;
    for (; j + W <= bk; j += W) {
      V<T> x = V<T>::loadu(src + o + j);
      for (int64_t r = 1; r < M; ++r) x = at::vec::maximum(x, V<T>::loadu(src + r * blk + o + j));
      x.store(dst + o + j);
    }
    for (; j < bk; ++j) {
      T x = src[o + j];
      for (int64_t r = 1; r < M; ++r) x = nanmax(x, src[r * blk + o + j]);
      dst[o + j] = x;
    }
  }
}

// Hard-E backward: src_r[i][j] becomes the share of component r in max_r s_r = mx[i][j]: 1 / (number of
// maximising components) where s_r attains the maximum, else 0 (a NaN maximum gives 0 shares).
template <typename T>
inline void tie_shares(T* src, int64_t M, size_t blk, const T* mx, int bq, int bk) {
  const int W = V<T>::size();
  const V<T> one(T(1));
  for (int i = 0; i < bq; ++i) {
    const int64_t o = static_cast<int64_t>(i) * kBlockK;
    int j = 0;
    for (; j + W <= bk; j += W) {
      const V<T> m = V<T>::loadu(mx + o + j);
      V<T> count(T(0));
      for (int64_t r = 0; r < M; ++r) {
        T* x = src + r * blk + o + j;
        const V<T> hit = V<T>::loadu(x).eq(m);  // 1 or 0
        hit.store(x);
        count = count + hit;
      }
      const V<T> share = one / at::vec::maximum(count, one);  // count 0 only where every indicator is 0
      for (int64_t r = 0; r < M; ++r) {
        T* x = src + r * blk + o + j;
        (V<T>::loadu(x) * share).store(x);
      }
    }
    for (; j < bk; ++j) {
      T count = 0;
      for (int64_t r = 0; r < M; ++r) {
        T& x = src[r * blk + o + j];
        x = x == mx[o + j] ? T(1) : T(0);
        count += x;
      }
      const T share = count > 0 ? T(1) / count : T(0);
      for (int64_t r = 0; r < M; ++r) src[r * blk + o + j] *= share;
    }
  }
}

// Adds bias (and row bias) to the raw scores of one (query block, key block, component), masks the causal
// triangle with -inf, and, when rowmax is given, raises it to the maximum of each row. With ``raw`` the raw scores
// are read from there and multiplied by ``scale`` first (shifted keys: one score GEMM for every component).
template <typename T>
inline void finish_scores(T* sc, int bq, int bk, const T* bias, const T* rowbias, int64_t q0, int64_t k0,
                          int64_t offset, bool causal, T* rowmax, const T* raw = nullptr, T scale = T(1)) {
  const T ninf = -std::numeric_limits<T>::infinity();
  const int W = V<T>::size();
  const V<T> vscale(scale);
  for (int i = 0; i < bq; ++i) {
    T* row = sc + static_cast<int64_t>(i) * kBlockK;
    const T* src = raw ? raw + static_cast<int64_t>(i) * kBlockK : row;
    const T rb = rowbias ? rowbias[i] : T(0);
    int visible = bk;
    if (causal) {
      const int64_t last = q0 + i + offset - k0;  // last visible key index inside this block
      visible = last < 0 ? 0 : (last + 1 < bk ? static_cast<int>(last + 1) : bk);
    }
    V<T> vmax(ninf), vrb(rb);
    int j = 0;
    for (; j + W <= visible; j += W) {
      V<T> s = at::vec::fmadd(V<T>::loadu(src + j), vscale, V<T>::loadu(bias + j) + vrb);
      s.store(row + j);
      vmax = at::vec::maximum(vmax, s);
    }
    T mx = at::vec::vec_reduce_all<T>([](const V<T>& a, const V<T>& b) { return at::vec::maximum(a, b); }, vmax);
    for (; j < visible; ++j) {
      row[j] = src[j] * scale + bias[j] + rb;
      mx = nanmax(mx, row[j]);
    }
    for (j = visible; j < bk; ++j) row[j] = ninf;
    if (rowmax) rowmax[i] = nanmax(rowmax[i], mx);
  }
}

// The finished scores (finish_scores) of every component of one (query block, key block) into sc (component r at
// sc + r * blk): one score GEMM per component, or for shifted keys (sh.scale) one GEMM into raw, scaled per
// component. qb: the block's queries (row stride qld) of query slice bh; kvs: the key group slice it reads.
template <typename T>
inline void block_scores(const Shapes<T>& sh, const T* qb, int64_t qld, const Rows<T>& k, const T* bias,
                         const T* rowbias, int64_t bh, int64_t kvs, int64_t q0, int64_t k0, int bq, int bk,
                         int64_t offset, bool causal, T* sc, size_t blk, T* raw, T* rowmax) {
  const bool shifted = sh.scale != nullptr;
  if (shifted)
    gemm(false, true, bq, bk, sh.D, T(1), qb, qld, k.at(kvs, k0, 0), k.ld, T(0), raw, kBlockK);
  for (int64_t r = 0; r < sh.M; ++r) {
    T* s = sc + r * blk;
    if (!shifted) gemm(false, true, bq, bk, sh.D, T(1), qb, qld, k.at(kvs, k0, r), k.ld, T(0), s, kBlockK);
    const T* rb = rowbias ? rowbias + (bh * sh.M + r) * sh.L + q0 : nullptr;
    finish_scores<T>(s, bq, bk, bias + (kvs * sh.M + r) * sh.S + k0, rb, q0, k0, offset, causal, rowmax,
                     shifted ? raw : nullptr, shifted ? sh.scale[kvs * sh.M + r] : T(1));
  }
}

// Soft-E statistics of one (query block, key block), fused into the forward pass: for each query row i that is
// real (query_ok) and each key j it sees, resp_r[j] += softmax_r(s_ijr), from the M score blocks the forward has
// just computed (bias and causal -inf included). Keys with every score -inf (masked, or above the causal diagonal)
// add nothing. resp points at the (M, S) statistics of this slice, offset to the block's first key.
template <typename T>
inline void add_responsibilities(const T* sc, int64_t M, size_t blk, int bq, int bk, const uint8_t* query_ok,
                                 T* resp, int64_t S) {
  const int W = V<T>::size();
  const T ninf = -std::numeric_limits<T>::infinity();
  const V<T> vninf(ninf), zero(T(0)), one(T(1));
  for (int i = 0; i < bq; ++i) {
    if (query_ok != nullptr && !query_ok[i]) continue;
    const int64_t o = static_cast<int64_t>(i) * kBlockK;
    int j = 0;
    for (; j + W <= bk; j += W) {
      V<T> m = V<T>::loadu(sc + o + j);
      for (int64_t r = 1; r < M; ++r) m = at::vec::maximum(m, V<T>::loadu(sc + r * blk + o + j));
      const V<T> live = m != vninf;
      const V<T> ms = V<T>::blendv(zero, m, live);
      V<T> total(T(0));
      for (int64_t r = 0; r < M; ++r) total = total + vexp<T>(V<T>::loadu(sc + r * blk + o + j) - ms);
      const V<T> w = V<T>::blendv(zero, one / total, live);
      for (int64_t r = 0; r < M; ++r) {
        T* x = resp + r * S + j;
        (V<T>::loadu(x) + vexp<T>(V<T>::loadu(sc + r * blk + o + j) - ms) * w).store(x);
      }
    }
    for (; j < bk; ++j) {
      T m = sc[o + j];
      for (int64_t r = 1; r < M; ++r) m = nanmax(m, sc[r * blk + o + j]);
      if (m == ninf) continue;
      T total = 0;
      for (int64_t r = 0; r < M; ++r) total += std::exp(sc[r * blk + o + j] - m);
      for (int64_t r = 0; r < M; ++r) resp[r * S + j] += std::exp(sc[r * blk + o + j] - m) / total;
    }
  }
}

template <typename T>
void forward_impl(const Rows<T>& q, const Rows<T>& k, const T* bias, const Rows<T>& v, const T* rowbias,
                  const Rows<T>& out, T* lse, const Shapes<T>& sh, const Dropout& drop, const uint8_t* query_ok,
                  T* resp) {
  const int64_t qblock = task_block(kBlockQ, 16, sh.BH, sh.L);
  const int64_t nqb = (sh.L + qblock - 1) / qblock;
  const int64_t offset = sh.S - sh.L;
  // With resp (Soft-E statistics), several tasks add to the same keys: each thread sums into its own buffer over
  // the slices of its task range, added in task order afterwards (the result does not depend on thread timing).
  struct Partial {
    int64_t begin, bh_lo;
    std::vector<T> resp;
  };
  std::vector<std::unique_ptr<Partial>> partials;
  std::mutex partials_lock;
  at::parallel_for(0, sh.BH * nqb, grain_for(sh, sh.BH * nqb), [&](int64_t begin, int64_t end) {
    SerialBlas serial;
    std::unique_ptr<Partial> part;
    if (resp) {
      part = std::make_unique<Partial>();
      part->begin = begin;
      part->bh_lo = begin / nqb;
      part->resp.assign(static_cast<size_t>(((end - 1) / nqb - part->bh_lo + 1) * sh.M * sh.S), T(0));
    }
    T* sc = scratch<T>(0, static_cast<size_t>(sh.M) * kBlockQ * kBlockK);
    T* p = scratch<T>(1, static_cast<size_t>(kBlockQ) * kBlockK);
    T* acc = scratch<T>(2, static_cast<size_t>(kBlockQ) * sh.Dv);
    T* m = scratch<T>(3, kBlockQ);
    T* l = scratch<T>(4, kBlockQ);
    T* mnew = scratch<T>(5, kBlockQ);
    T* raw = sh.scale ? scratch<T>(6, static_cast<size_t>(kBlockQ) * kBlockK) : nullptr;
    const T ninf = -std::numeric_limits<T>::infinity();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / nqb, q0 = (task % nqb) * qblock, kvs = sh.kv(bh);
      const int bq = static_cast<int>(std::min<int64_t>(qblock, sh.L - q0));
      const T* qb = q.at(bh, q0);
      std::fill(acc, acc + static_cast<int64_t>(kBlockQ) * sh.Dv, T(0));
      std::fill(m, m + kBlockQ, ninf);
      std::fill(l, l + kBlockQ, T(0));
      int64_t kend = sh.S;
      if (sh.causal) kend = std::min<int64_t>(sh.S, q0 + bq - 1 + offset + 1);
      for (int64_t k0 = 0; k0 < kend; k0 += kBlockK) {
        const int bk = static_cast<int>(std::min<int64_t>(kBlockK, sh.S - k0));
        std::copy(m, m + bq, mnew);
        block_scores<T>(sh, qb, q.ld, k, bias, rowbias, bh, kvs, q0, k0, bq, bk, offset, sh.causal, sc,
                        static_cast<size_t>(kBlockQ) * kBlockK, raw, mnew);
        if (part)
          add_responsibilities<T>(sc, sh.M, static_cast<size_t>(kBlockQ) * kBlockK, bq, bk,
                                  query_ok ? query_ok + bh * sh.L + q0 : nullptr,
                                  part->resp.data() + (bh - part->bh_lo) * sh.M * sh.S + k0, sh.S);
        // Hard-E: the key's score is the best component's, max_r s_r, instead of their log-sum-exp.
        const int64_t terms = sh.hard ? 1 : sh.M;
        if (sh.hard) max_over_components<T>(sc, sh.M, static_cast<size_t>(kBlockQ) * kBlockK, bq, bk, sc);
        for (int i = 0; i < bq; ++i) {
          T* pi = p + static_cast<int64_t>(i) * kBlockK;
          const T mi = mnew[i];
          if (mi == ninf) {  // nothing visible yet in this row
            std::fill(pi, pi + bk, T(0));
            continue;
          }
          for (int64_t r = 0; r < terms; ++r)
            exp_shift<T>(sc + r * kBlockQ * kBlockK + static_cast<int64_t>(i) * kBlockK, mi, pi, bk, r > 0);
          T rowsum = at::vec::reduce_all<T>([](const V<T>& a, const V<T>& b) { return a + b; }, pi, bk);
          const T alpha = m[i] == ninf ? T(0) : std::exp(m[i] - mi);
          l[i] = l[i] * alpha + rowsum;
          // The normaliser l sums the kept and the dropped weights: dropout acts on the normalised weights.
          if (drop.on()) dropout_row<T>(dropout_row_key(drop, bh, sh.L, q0 + i), k0, bk, drop, pi, nullptr);
          T* ai = acc + static_cast<int64_t>(i) * sh.Dv;
          if (alpha != T(1))
            for (int64_t d = 0; d < sh.Dv; ++d) ai[d] *= alpha;
          m[i] = mi;
        }
        gemm(false, false, bq, sh.Dv, bk, T(1), p, kBlockK, v.at(kvs, k0), v.ld, T(1), acc, sh.Dv);
      }
      for (int i = 0; i < bq; ++i) {
        T* oi = out.at(bh, q0 + i);
        const T* ai = acc + static_cast<int64_t>(i) * sh.Dv;
        if (l[i] > T(0) || std::isnan(l[i])) {  // NaN scores give NaN, as in the formula
          const T inv = T(1) / l[i];
          for (int64_t d = 0; d < sh.Dv; ++d) oi[d] = ai[d] * inv;
          lse[bh * sh.L + q0 + i] = m[i] + std::log(l[i]);
        } else {  // a row that sees no key: zero output, -inf log-sum-exp
          for (int64_t d = 0; d < sh.Dv; ++d) oi[d] = T(0);
          lse[bh * sh.L + q0 + i] = ninf;
        }
      }
    }
    if (part) {
      std::lock_guard<std::mutex> guard(partials_lock);
      partials.push_back(std::move(part));
    }
  });
  std::sort(partials.begin(), partials.end(), [](const auto& x, const auto& y) { return x->begin < y->begin; });
  for (const auto& part : partials) {
    T* d = resp + part->bh_lo * sh.M * sh.S;
    for (size_t x = 0; x < part->resp.size(); ++x) d[x] += part->resp[x];
  }
}

// s = exp(s - LSE_i) in place for each row i (rows whose LSE is -inf see no key: 0).
template <typename T>
inline void probs_from_scores(T* s, const T* lse, int bq, int bk) {
  const T ninf = -std::numeric_limits<T>::infinity();
  for (int i = 0; i < bq; ++i) {
    T* row = s + static_cast<int64_t>(i) * kBlockK;
    if (lse[i] == ninf) std::fill(row, row + bk, T(0));
    else exp_shift<T>(row, lse[i], row, bk, false);
  }
}

// dS_r = P_r * (dP - delta) (Hard-E: w_r * P * (dP - delta)) in place over the M score blocks, their column sums
// added to the per-key bias gradient and row sums to the row bias gradient (drb, or nullptr); t: the rows' dP - delta.
template <typename T>
inline void score_gradients(const Shapes<T>& sh, T* pr, size_t blk, const T* t, T* dbias, int64_t kvs, int64_t k0,
                            T* drb, int bq, int bk) {
  for (int64_t r = 0; r < sh.M; ++r) {
    T* ds = pr + r * blk;
    T* dbias_r = dbias + (kvs * sh.M + r) * sh.S + k0;
    for (int i = 0; i < bq; ++i) {
      const T rs = mul_colsum_rowsum<T>(ds + static_cast<int64_t>(i) * kBlockK, t + static_cast<int64_t>(i) * kBlockK,
                                        dbias_r, bk);
      if (drb) drb[r * sh.L + i] += rs;
    }
  }
}

// Shifted keys: cmb = sum_r scale_r dS_r (the gradient of the one score GEMM) and dscale_r += sum_ij dS_ijr raw_ij.
template <typename T>
inline void combine_components(const Shapes<T>& sh, const T* pr, size_t blk, const T* raw, int64_t kvs, T* cmb,
                               T* dscale, int bq, int bk) {
  for (int i = 0; i < bq; ++i) {
    const int64_t o = static_cast<int64_t>(i) * kBlockK;
    for (int j = 0; j < bk; ++j) cmb[o + j] = T(0);
    for (int64_t r = 0; r < sh.M; ++r) {
      const T sr = sh.scale[kvs * sh.M + r];
      const T* ds = pr + r * blk + o;
      T acc = 0;
      for (int j = 0; j < bk; ++j) {
        cmb[o + j] += sr * ds[j];
        acc += ds[j] * raw[o + j];
      }
      dscale[r] += acc;
    }
  }
}

// The gradients one key block (k0, bk of key group slice kvs) takes from the queries of slice bh: dK, dV and the
// per-key bias gradient of the block in place (the task owns them), dQ, the row bias and scale gradients into the
// task's partial buffers dqp (L, D), drbp (M, L) and dscp (M) (nullptr when not wanted).
template <typename T>
void backward_block(const Rows<T>& dout, const Rows<T>& q, const Rows<T>& k, const T* bias, const Rows<T>& v,
                    const T* rowbias, const T* lse, const T* delta, const Rows<T>& dk, T* dbias, const Rows<T>& dv,
                    const Shapes<T>& sh, const Dropout& drop, int64_t bh, int64_t kvs, int64_t k0, int bk,
                    int64_t offset, size_t blk, T* pr, T* a, T* dp, T* z, T* raw, T* cmb, T* dqp, T* drbp, T* dscp) {
  const T* vb = v.at(kvs, k0);
  T* dvb = dv.at(kvs, k0);
  int64_t qstart = 0;
  if (sh.causal) qstart = std::max<int64_t>(0, k0 - offset) / kBlockQ * kBlockQ;
  for (int64_t q0 = qstart; q0 < sh.L; q0 += kBlockQ) {
    const int bq = static_cast<int>(std::min<int64_t>(kBlockQ, sh.L - q0));
    const T* qb = q.at(bh, q0);
    const T* dob = dout.at(bh, q0);
    const T* lseb = lse + bh * sh.L + q0;
    const T* delb = delta + bh * sh.L + q0;
    block_scores<T>(sh, qb, q.ld, k, bias, rowbias, bh, kvs, q0, k0, bq, bk, offset, sh.causal, pr, blk, raw,
                    nullptr);
    if (!sh.hard) {
      // P_r = exp(s_r - LSE) in place; A = sum_r P_r. dS_r = P_r * (dP - delta) below.
      for (int64_t r = 0; r < sh.M; ++r) probs_from_scores<T>(pr + r * blk, lseb, bq, bk);
      for (int i = 0; i < bq; ++i) {
        T* ai = a + static_cast<int64_t>(i) * kBlockK;
        std::copy(pr + static_cast<int64_t>(i) * kBlockK, pr + static_cast<int64_t>(i) * kBlockK + bk, ai);
        for (int64_t r = 1; r < sh.M; ++r) {
          const T* x = pr + r * blk + static_cast<int64_t>(i) * kBlockK;
          for (int j = 0; j < bk; ++j) ai[j] += x[j];
        }
      }
    } else {
      // A = P = exp(max_r s_r - LSE); the gradient of the max goes to the maximising components, split evenly
      // between ties (as torch.amax's backward does): pr[r] becomes that share w_r, and dS_r = w_r * dS below.
      max_over_components<T>(pr, sh.M, blk, bq, bk, a);
      tie_shares<T>(pr, sh.M, blk, a, bq, bk);
      probs_from_scores<T>(a, lseb, bq, bk);
    }
    // dV += A^T dO;  dP = dO V^T;  T = dP - delta (times P for Hard-E). With dropout (keep factors Z): the
    // output is (A * Z) V, so dV uses A * Z and dA = dP * Z; delta = rowsum(dO * O) with the dropped O still
    // equals sum_j A_ij dA_ij, so dS keeps its form.
    const T* aw = a;
    if (drop.on()) {
      for (int i = 0; i < bq; ++i) {
        const int64_t o = static_cast<int64_t>(i) * kBlockK;
        dropout_row<T>(dropout_row_key(drop, bh, sh.L, q0 + i), k0, bk, drop, static_cast<T*>(nullptr), z + o);
        for (int j = 0; j < bk; ++j) dp[o + j] = a[o + j] * z[o + j];
      }
      aw = dp;  // A * Z, consumed by the dV GEMM before dp is overwritten
    }
    gemm(true, false, bk, sh.Dv, bq, T(1), aw, kBlockK, dob, dout.ld, T(1), dvb, dv.ld);
    gemm(false, true, bq, bk, sh.Dv, T(1), dob, dout.ld, vb, v.ld, T(0), dp, kBlockK);
    for (int i = 0; i < bq; ++i) {
      T* row = dp + static_cast<int64_t>(i) * kBlockK;
      const T di = delb[i];
      if (z) {
        const T* zi = z + static_cast<int64_t>(i) * kBlockK;
        for (int j = 0; j < bk; ++j) row[j] = row[j] * zi[j] - di;
      } else {
        for (int j = 0; j < bk; ++j) row[j] -= di;
      }
      if (sh.hard) {
        const T* pi = a + static_cast<int64_t>(i) * kBlockK;
        for (int j = 0; j < bk; ++j) row[j] *= pi[j];
      }
    }
    score_gradients<T>(sh, pr, blk, dp, dbias, kvs, k0, drbp ? drbp + q0 : nullptr, bq, bk);
    T* dqb = dqp + q0 * sh.D;
    if (sh.scale) {  // one score GEMM: its gradient sum_r scale_r dS_r, two GEMMs
      combine_components<T>(sh, pr, blk, raw, kvs, cmb, dscp, bq, bk);
      gemm(true, false, bk, sh.D, bq, T(1), cmb, kBlockK, qb, q.ld, T(1), dk.at(kvs, k0, 0), dk.ld);
      gemm(false, false, bq, sh.D, bk, T(1), cmb, kBlockK, k.at(kvs, k0, 0), k.ld, T(1), dqb, sh.D);
      continue;
    }
    for (int64_t r = 0; r < sh.M; ++r) {
      const T* ds = pr + r * blk;  // dS_r
      gemm(true, false, bk, sh.D, bq, T(1), ds, kBlockK, qb, q.ld, T(1), dk.at(kvs, k0, r), dk.ld);
      gemm(false, false, bq, sh.D, bk, T(1), ds, kBlockK, k.at(kvs, k0, r), k.ld, T(1), dqb, sh.D);
    }
  }
}

template <typename T>
void backward_impl(const Rows<T>& dout, const Rows<T>& q, const Rows<T>& k, const T* bias, const Rows<T>& v,
                   const T* rowbias, const T* lse, const T* delta, const Rows<T>& dq, const Rows<T>& dk, T* dbias,
                   const Rows<T>& dv, T* drowbias, T* dscale, const Shapes<T>& sh, const Dropout& drop) {
  // Tasks own (key group slice, key block): the R query heads of a group add to its dK, dV and bias gradient one
  // after the other, in one task. dQ (and the row-bias and scale gradients) of a query receives contributions from
  // every key block; each thread accumulates into its own buffer covering the slices of its task range, added in
  // task order afterwards, so the result does not depend on thread timing.
  const int64_t BG = sh.BH / sh.R;
  const int64_t kblock = task_block(kBlockK, 64, BG, sh.S);
  const int64_t nkb = (sh.S + kblock - 1) / kblock;
  const int64_t offset = sh.S - sh.L;
  struct Partial {
    int64_t begin, kv_lo, nkv;
    std::vector<T> dq, drb, dsc;
  };
  std::vector<std::unique_ptr<Partial>> partials;
  std::mutex partials_lock;
  at::parallel_for(0, BG * nkb, grain_for(sh, BG * nkb), [&](int64_t begin, int64_t end) {
    SerialBlas serial;
    const size_t blk = static_cast<size_t>(kBlockQ) * kBlockK;
    T* pr = scratch<T>(0, static_cast<size_t>(sh.M) * blk);
    T* a = scratch<T>(1, blk);
    T* dp = scratch<T>(2, blk);
    T* z = drop.on() ? scratch<T>(3, blk) : nullptr;
    T* raw = sh.scale ? scratch<T>(4, blk) : nullptr;
    T* cmb = sh.scale ? scratch<T>(5, blk) : nullptr;
    auto part = std::make_unique<Partial>();
    part->begin = begin;
    part->kv_lo = begin / nkb;
    part->nkv = (end - 1) / nkb - part->kv_lo + 1;
    part->dq.assign(static_cast<size_t>(part->nkv * sh.R * sh.L * sh.D), T(0));
    if (drowbias) part->drb.assign(static_cast<size_t>(part->nkv * sh.R * sh.M * sh.L), T(0));
    if (dscale) part->dsc.assign(static_cast<size_t>(part->nkv * sh.M), T(0));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kvs = task / nkb, k0 = (task % nkb) * kblock;
      const int bk = static_cast<int>(std::min<int64_t>(kblock, sh.S - k0));
      for (int64_t bh = kvs * sh.R; bh < (kvs + 1) * sh.R; ++bh)
        backward_block<T>(dout, q, k, bias, v, rowbias, lse, delta, dk, dbias, dv, sh, drop, bh, kvs, k0, bk,
                          offset, blk, pr, a, dp, z, raw, cmb, part->dq.data() + (bh - part->kv_lo * sh.R) * sh.L * sh.D,
                          drowbias ? part->drb.data() + (bh - part->kv_lo * sh.R) * sh.M * sh.L : nullptr,
                          dscale ? part->dsc.data() + (kvs - part->kv_lo) * sh.M : nullptr);
    }
    std::lock_guard<std::mutex> guard(partials_lock);
    partials.push_back(std::move(part));
  });
  std::sort(partials.begin(), partials.end(), [](const auto& x, const auto& y) { return x->begin < y->begin; });
  for (const auto& part : partials) {
    const int64_t bh_lo = part->kv_lo * sh.R;
    for (int64_t b = 0; b < part->nkv * sh.R; ++b)
      for (int64_t i = 0; i < sh.L; ++i) {
        T* d = dq.at(bh_lo + b, i);
        const T* x = part->dq.data() + (b * sh.L + i) * sh.D;
        for (int64_t c = 0; c < sh.D; ++c) d[c] += x[c];
      }
    if (drowbias) {
      T* e = drowbias + bh_lo * sh.M * sh.L;
      for (size_t x = 0; x < part->drb.size(); ++x) e[x] += part->drb[x];
    }
    if (dscale) {
      T* e = dscale + part->kv_lo * sh.M;
      for (size_t x = 0; x < part->dsc.size(); ++x) e[x] += part->dsc[x];
    }
  }
}

// Soft-E E-step: resp[r][j] = sum over queries i that may attend to j of softmax_r(s_ijr). Tasks own key blocks.
template <typename T>
void responsibilities_impl(const T* q, const T* k, const T* bias, const T* rowbias, const uint8_t* query_ok,
                           const uint8_t* key_ok, T* resp, const Shapes<T>& sh) {
  const int64_t kblock = task_block(kBlockK, 64, sh.BH, sh.S);
  const int64_t nkb = (sh.S + kblock - 1) / kblock;
  const int64_t offset = sh.S - sh.L;
  const size_t blk = static_cast<size_t>(kBlockQ) * kBlockK;
  at::parallel_for(0, sh.BH * nkb, grain_for(sh, sh.BH * nkb), [&](int64_t begin, int64_t end) {
    SerialBlas serial;
    T* sc = scratch<T>(0, static_cast<size_t>(sh.M) * blk);
    T* keep = scratch<T>(1, kBlockK);
    const int W = V<T>::size();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / nkb, k0 = (task % nkb) * kblock;
      const int bk = static_cast<int>(std::min<int64_t>(kblock, sh.S - k0));
      for (int j = 0; j < bk; ++j) keep[j] = (key_ok == nullptr || key_ok[bh * sh.S + k0 + j]) ? T(1) : T(0);
      int64_t qstart = 0;
      if (sh.causal) qstart = std::max<int64_t>(0, k0 - offset) / kBlockQ * kBlockQ;
      for (int64_t q0 = qstart; q0 < sh.L; q0 += kBlockQ) {
        const int bq = static_cast<int>(std::min<int64_t>(kBlockQ, sh.L - q0));
        const T* qb = q + (bh * sh.L + q0) * sh.D;
        for (int64_t r = 0; r < sh.M; ++r) {
          T* s = sc + r * blk;
          gemm(false, true, bq, bk, sh.D, T(1), qb, sh.D, k + ((bh * sh.M + r) * sh.S + k0) * sh.D, sh.D, T(0), s,
               kBlockK);
          const T* rb = rowbias ? rowbias + (bh * sh.M + r) * sh.L + q0 : nullptr;
          finish_scores<T>(s, bq, bk, bias + (bh * sh.M + r) * sh.S + k0, rb, q0, k0, offset, false, nullptr);
        }
        for (int i = 0; i < bq; ++i) {
          if (query_ok != nullptr && !query_ok[bh * sh.L + q0 + i]) continue;
          int visible = bk;
          if (sh.causal) {
            const int64_t last = q0 + i + offset - k0;
            visible = last < 0 ? 0 : (last + 1 < bk ? static_cast<int>(last + 1) : bk);
          }
          const int64_t o = static_cast<int64_t>(i) * kBlockK;
          int j = 0;
          for (; j + W <= visible; j += W) {
            V<T> m = V<T>::loadu(sc + o + j);
            for (int64_t r = 1; r < sh.M; ++r) m = at::vec::maximum(m, V<T>::loadu(sc + r * blk + o + j));
            V<T> total(T(0));
            for (int64_t r = 0; r < sh.M; ++r) total = total + vexp<T>(V<T>::loadu(sc + r * blk + o + j) - m);
            const V<T> w = V<T>::loadu(keep + j) / total;
            for (int64_t r = 0; r < sh.M; ++r) {
              T* out = resp + (bh * sh.M + r) * sh.S + k0 + j;
              (V<T>::loadu(out) + vexp<T>(V<T>::loadu(sc + r * blk + o + j) - m) * w).store(out);
            }
          }
          for (; j < visible; ++j) {
            T m = sc[o + j];
            for (int64_t r = 1; r < sh.M; ++r) m = nanmax(m, sc[r * blk + o + j]);
            T total = 0;
            for (int64_t r = 0; r < sh.M; ++r) total += std::exp(sc[r * blk + o + j] - m);
            for (int64_t r = 0; r < sh.M; ++r)
              resp[(bh * sh.M + r) * sh.S + k0 + j] += keep[j] * std::exp(sc[r * blk + o + j] - m) / total;
          }
        }
      }
    }
  });
}

void check(const torch::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got ", t.dim());
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble, name, " must be float32 or float64");
}

// A tensor the kernel reads by rows (Rows): (B, H, rows, cols) or (BH, rows, cols), with `extra` more dimensions
// (the keys' components) before the rows; unit column stride, row stride >= cols. Returns the number of slices BH.
int64_t check_rows(const torch::Tensor& t, const char* name, int64_t extra) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 3 + extra || t.dim() == 4 + extra, name, " must have ", 3 + extra, " or ", 4 + extra,
              " dimensions, got ", t.dim());
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble, name, " must be float32 or float64");
  // an empty tensor has no row to read (its strides may be anything)
  TORCH_CHECK(t.numel() == 0 || ((t.stride(-1) == 1 || t.size(-1) <= 1) &&
                                 (t.size(-2) <= 1 || t.stride(-2) >= t.size(-1))),
              name, " must have unit column stride and a row stride >= its row length");
  return t.dim() == 4 + extra ? t.size(0) * t.size(1) : t.size(0);
}

// The slices and sizes the kernel assumes of its inputs, given q's and k's (a direct caller of the private
// functions gets an error instead of reads past a tensor's end): q (BH slices), k (.., Mk, S, D) and v (.., S, Dv) of
// BG key group slices dividing BH (4-dim q for BG < BH: its heads a multiple of the groups), bias (BG, M, S), Mk = M
// or 1 with scale (BG, M) (shifted keys), rowbias empty or (BH, M, L), one dtype. Returns the sizes of a Shapes.
template <typename T>
Shapes<T> check_sizes(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& bias,
                      const torch::Tensor& v, const torch::Tensor& rowbias, const torch::Tensor& scale, bool causal,
                      bool hard) {
  const int64_t BH = check_rows(q, "q", 0), BG = check_rows(k, "k", 1);
  TORCH_CHECK(check_rows(v, "v", 0) == BG, "k and v must hold the same slices");
  check(bias, "bias", 3);
  const auto dt = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == dt && v.scalar_type() == dt && bias.scalar_type() == dt &&
              (rowbias.numel() == 0 || rowbias.scalar_type() == dt) && (scale.numel() == 0 || scale.scalar_type() == dt),
              "q, k, bias, v, rowbias and scale must share one dtype");
  const int64_t M = bias.size(1), Mk = k.size(-3), L = q.size(-2), S = k.size(-2), D = q.size(-1), Dv = v.size(-1);
  const int64_t H = q.dim() == 4 ? q.size(1) : 1;
  TORCH_CHECK(BG == BH || (BG > 0 && BH % BG == 0 && q.dim() == 4 && k.dim() == 5 && H % (BH / BG) == 0),
              "k's slices (key groups) must divide q's, as (B, G, ...) against (B, H, ...)");
  TORCH_CHECK(D > 0 && Dv > 0, "head sizes must be positive (BLAS needs leading dimensions >= 1)");
  TORCH_CHECK(k.size(-1) == D, "k's head size (", k.size(-1), ") must equal q's (", D, ")");
  TORCH_CHECK(v.size(-2) == S, "v must hold one row per key position (", S, "), got ", v.size(-2));
  TORCH_CHECK(bias.size(0) == BG && bias.size(2) == S && M >= 1 && (Mk == M || scale.numel() > 0),
              "bias must be (BG, M, S) = (", BG, ", ", Mk, ", ", S, ") for k's components (or M of them for one "
              "shifted key with scale)");
  TORCH_CHECK(scale.numel() == 0 || (Mk == 1 && scale.is_contiguous() && scale.dim() == 2 && scale.size(0) == BG &&
                                     scale.size(1) == M),
              "scale must be empty or, with one key component, contiguous (BG, M) = (", BG, ", ", M, ")");
  TORCH_CHECK(rowbias.numel() == 0 || (rowbias.dim() == 3 && rowbias.size(0) == BH && rowbias.size(1) == M &&
                                       rowbias.size(2) == L),
              "rowbias must be empty or (BH, M, L) = (", BH, ", ", M, ", ", L, ")");
  if (rowbias.numel() > 0) check(rowbias, "rowbias", 3);
  Shapes<T> sh{BH, M, L, S, D, Dv, causal, hard};
  sh.H = H;
  sh.R = BG == 0 ? 1 : BH / BG;
  sh.Mk = Mk;
  sh.scale = scale.numel() > 0 ? scale.data_ptr<T>() : nullptr;
  return sh;
}

// out (or a gradient) shaped like q's rows with `cols` columns: for (B, H, L, D) queries laid out as (B, L, H, D),
// the projections' layout, so that merging the heads afterwards is a view.
torch::Tensor rows_like(const torch::Tensor& q, int64_t cols) {
  if (q.dim() == 4)
    return torch::empty({q.size(0), q.size(2), q.size(1), cols}, q.options()).permute({0, 2, 1, 3});
  return torch::empty({q.size(0), q.size(1), cols}, q.options());
}

// Zeros for the gradient of t: in t's own layout when that is a permutation of a contiguous layout with adjacent
// columns (the projections' views: no copy on the way back), else contiguous. Not zeros_like alone: for a tensor
// whose batch or head rows overlap (stride 1 along them) it orders the dimensions by stride, and the columns would
// no longer be adjacent. _mixture_flash._grad_like is the same rule for torch.compile's fake tensors.
torch::Tensor grad_like(const torch::Tensor& t) {
  if (t.is_non_overlapping_and_dense() && (t.size(-1) <= 1 || t.stride(-1) == 1)) return torch::zeros_like(t);
  return torch::zeros(t.sizes(), t.options());
}

}  // namespace

// q (B, H, L, D), k (B, G, Mk, S, D), v (B, G, S, Dv) (or each with one (BH) leading dimension when G = H; any
// strides of check_rows), bias (BG, M, S), rowbias (BH, M, L) or empty, scale (BG, M) with Mk = 1 (shifted keys)
// or empty -> out (B, H, L, Dv) laid out as (B, L, H, Dv), lse (BH, L), and with stats (G = H) the Soft-E
// statistics resp (BH, M, S) of the real queries (query_ok (BH, L) bool, or empty: all); resp is empty without
// stats.
std::vector<torch::Tensor> mixture_flash_forward(torch::Tensor q, torch::Tensor k, torch::Tensor bias,
                                                 torch::Tensor v, torch::Tensor rowbias, torch::Tensor scale,
                                                 torch::Tensor query_ok, bool causal, bool hard, double dropout_p,
                                                 int64_t seed, int64_t offset, bool stats) {
  const Dropout drop = make_dropout(dropout_p, seed, offset);
  const int64_t BH = check_rows(q, "q", 0), L = q.size(-2), Dv = v.size(-1);
  TORCH_CHECK(!(stats && hard), "Soft-E statistics are defined for the sum mixture only");
  TORCH_CHECK(!stats || check_rows(k, "k", 1) == BH, "Soft-E statistics need one key slice per query slice");
  TORCH_CHECK(query_ok.numel() == 0 || (query_ok.scalar_type() == at::kBool && query_ok.is_contiguous() &&
                                        query_ok.dim() == 2 && query_ok.size(0) == BH && query_ok.size(1) == L),
              "query_ok must be contiguous bool (BH, L)");
  auto out = rows_like(q, Dv);
  auto lse = torch::empty({BH, L}, q.options());
  auto resp = stats ? torch::zeros({BH, bias.size(1), k.size(-2)}, q.options()) : torch::empty({0}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "mixture_flash_forward", [&] {
    const Shapes<scalar_t> sh = check_sizes<scalar_t>(q, k, bias, v, rowbias, scale, causal, hard);
    forward_impl<scalar_t>(rows_of<scalar_t>(q, false), rows_of<scalar_t>(k, true), bias.data_ptr<scalar_t>(),
                           rows_of<scalar_t>(v, false), rowbias.numel() ? rowbias.data_ptr<scalar_t>() : nullptr,
                           rows_of<scalar_t>(out, false), lse.data_ptr<scalar_t>(), sh, drop,
                           query_ok.numel() ? reinterpret_cast<const uint8_t*>(query_ok.data_ptr<bool>()) : nullptr,
                           stats ? resp.data_ptr<scalar_t>() : nullptr);
  });
  return {out, lse, resp};
}

// Gradients of the forward above given dout and the forward's out/lse (delta = rowsum(dout * out)): dq, dk, dbias,
// dv, drowbias (empty without rowbias), dscale (empty without scale).
std::vector<torch::Tensor> mixture_flash_backward(torch::Tensor dout, torch::Tensor q, torch::Tensor k,
                                                  torch::Tensor bias, torch::Tensor v, torch::Tensor rowbias,
                                                  torch::Tensor scale, torch::Tensor lse, torch::Tensor delta,
                                                  bool causal, bool hard, double dropout_p, int64_t seed,
                                                  int64_t offset) {
  const Dropout drop = make_dropout(dropout_p, seed, offset);
  const int64_t BH = check_rows(q, "q", 0), L = q.size(-2), Dv = v.size(-1);
  TORCH_CHECK(check_rows(dout, "dout", 0) == BH, "dout and q must hold the same slices");
  check(lse, "lse", 2); check(delta, "delta", 2);
  TORCH_CHECK(dout.size(-2) == L && dout.size(-1) == Dv && dout.scalar_type() == q.scalar_type() &&
              lse.size(0) == BH && lse.size(1) == L && delta.sizes() == lse.sizes() &&
              lse.scalar_type() == q.scalar_type() && delta.scalar_type() == q.scalar_type(),
              "dout (.., L, Dv), lse and delta (BH, L) must match the forward's sizes and dtype");
  const bool has_rb = rowbias.numel() > 0, has_scale = scale.numel() > 0;
  // Gradients in their inputs' layouts where those are dense (grad_like): no copies on the way back to the
  // projections.
  auto dq = grad_like(q), dk = grad_like(k), dbias = torch::zeros_like(bias), dv = grad_like(v);
  auto drb = has_rb ? torch::zeros_like(rowbias) : torch::empty({0}, q.options());
  auto dscale = has_scale ? torch::zeros_like(scale) : torch::empty({0}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "mixture_flash_backward", [&] {
    const Shapes<scalar_t> sh = check_sizes<scalar_t>(q, k, bias, v, rowbias, scale, causal, hard);
    backward_impl<scalar_t>(rows_of<scalar_t>(dout, false), rows_of<scalar_t>(q, false), rows_of<scalar_t>(k, true),
                            bias.data_ptr<scalar_t>(), rows_of<scalar_t>(v, false),
                            has_rb ? rowbias.data_ptr<scalar_t>() : nullptr, lse.data_ptr<scalar_t>(),
                            delta.data_ptr<scalar_t>(), rows_of<scalar_t>(dq, false), rows_of<scalar_t>(dk, true),
                            dbias.data_ptr<scalar_t>(), rows_of<scalar_t>(dv, false),
                            has_rb ? drb.data_ptr<scalar_t>() : nullptr,
                            has_scale ? dscale.data_ptr<scalar_t>() : nullptr, sh, drop);
  });
  return {dq, dk, dbias, dv, drb, dscale};
}

// Soft-E statistics: q (BH, L, D), k (BH, M, S, D), bias (BH, M, S), rowbias (BH, M, L) or empty, query_ok
// (BH, L) and key_ok (BH, S) bool or empty -> resp (BH, M, S).
torch::Tensor mixture_responsibilities(torch::Tensor q, torch::Tensor k, torch::Tensor bias, torch::Tensor rowbias,
                                       torch::Tensor query_ok, torch::Tensor key_ok, bool causal) {
  check(q, "q", 3); check(k, "k", 4); check(bias, "bias", 3);
  TORCH_CHECK(q.size(2) > 0, "head size must be positive");
  const bool has_rb = rowbias.numel() > 0;
  if (has_rb) check(rowbias, "rowbias", 3);
  for (const auto* t : {&query_ok, &key_ok})
    TORCH_CHECK(t->numel() == 0 || (t->scalar_type() == at::kBool && t->is_contiguous() && t->dim() == 2),
                "query_ok/key_ok must be contiguous bool (BH, L)/(BH, S)");
  auto resp = torch::zeros({k.size(0), k.size(1), k.size(2)}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "mixture_responsibilities", [&] {
    Shapes<scalar_t> sh{q.size(0), k.size(1), q.size(1), k.size(2), q.size(2), q.size(2), causal, false};
    responsibilities_impl<scalar_t>(
        q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), bias.data_ptr<scalar_t>(),
        has_rb ? rowbias.data_ptr<scalar_t>() : nullptr,
        query_ok.numel() ? reinterpret_cast<const uint8_t*>(query_ok.data_ptr<bool>()) : nullptr,
        key_ok.numel() ? reinterpret_cast<const uint8_t*>(key_ok.data_ptr<bool>()) : nullptr,
        resp.data_ptr<scalar_t>(), sh);
  });
  return resp;
}

// The keep mask (BH, L, S) bool that forward and backward apply for these dropout arguments (for tests).
torch::Tensor mixture_dropout_mask(int64_t BH, int64_t L, int64_t S, double dropout_p, int64_t seed,
                                   int64_t offset) {
  const Dropout drop = make_dropout(dropout_p, seed, offset);
  auto keep = torch::ones({BH, L, S}, torch::kFloat);
  float* x = keep.data_ptr<float>();
  if (drop.on())
    for (int64_t bh = 0; bh < BH; ++bh)
      for (int64_t i = 0; i < L; ++i)
        dropout_row<float>(dropout_row_key(drop, bh, L, i), 0, static_cast<int>(S), drop, x + (bh * L + i) * S,
                           nullptr);
  return keep > 0;
}

// mixture_decode.cpp
torch::Tensor mixture_decode(torch::Tensor q, torch::Tensor keys, torch::Tensor scale, torch::Tensor bias,
                             torch::Tensor rowbias, torch::Tensor v, torch::Tensor valid, bool causal, bool hard,
                             int64_t period);

torch::Tensor mixture_decode_step(torch::Tensor q, torch::Tensor key_new, torch::Tensor bias_new,
                                  torch::Tensor value_new, torch::Tensor centre, torch::Tensor inv_s2,
                                  torch::Tensor shifts, bool qnorm, torch::Tensor keys_buf, torch::Tensor bias_buf,
                                  torch::Tensor values_buf, torch::Tensor valid, int64_t t, bool hard);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dropout_mask", &mixture_dropout_mask, "keep mask of the kernel's attention dropout (CPU)");
  m.def("forward", &mixture_flash_forward, "MGK mixture flash forward (CPU)");
  m.def("backward", &mixture_flash_backward, "MGK mixture flash backward (CPU)");
  m.def("responsibilities", &mixture_responsibilities, "Soft-E E-step statistics (CPU)");
  m.def("decode", &mixture_decode, "MGK decoding step over a cache read in place (CPU)");
  m.def("decode_step", &mixture_decode_step, "MGK decoding step: write the given new entries, then attend (CPU)");
}

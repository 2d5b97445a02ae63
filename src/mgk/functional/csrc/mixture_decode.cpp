// Fused CPU decoding step for MGK and sMGK: a few new queries against a decoding cache, read in place.
//
// For slice (b, h), new query l, cached key position j and mixture component r the score is
//
//     s_lrj = scale_hr * (q_l . k_j[r]) + bias_jr + rowbias_rl
//
// where the cache holds either M keys per position (MGK: k_j[r] = k~_jr / sigma_r^2, scale 1) or one (sMGK:
// k_j[r] = k~_j for every r, scale 1 / sigma_r^2 and the shifts folded into rowbias), and bias_jr the per-key
// scalars. No kernel here computes a per-key term: the entries (keys and bias_jr) are made in PyTorch by the one
// formula (mgk/functional/_mixture_terms.py, through mgk_cache.py), and the step below only copies the new ones
// into the cache's buffers before it attends. The output is
// out_l = sum_j A_lj v_j / sum_j A_lj with A_lj = sum_r exp(s_lrj - m_l) (mixture "sum", paper eq. 9) or
// exp(max_r s_lrj - m_l) (Hard-E), m_l the largest score of row l. Masked keys (valid_bj false, or j > l + S - L
// under causal masking, aligned bottom-right) score -inf; a row with no visible key is 0.
//
// Grouped keys (gMGK: H query heads share G key groups): the caller folds the H / G query heads of a group into its
// rows, (B, G, (H / G) L, D), so that a slice reads its group's keys and values once for all of them. The causal
// alignment then repeats with period L: folded row f is query f % L of one head.
//
// Why a kernel of its own: a decoding step is memory-bound (each cached number is read once per step), and the
// GEMM form (one score GEMM over M * S keys, bias add, softmax, value GEMM) makes several passes over the
// (M, S) scores besides. Here the keys and values are streamed once, straight from the cache's buffers (strided
// views: slots beyond the ones in use are never read, nothing is copied), and the scores of one slice
// (L * M * S numbers) stay in a per-thread buffer in cache. Slices run in parallel. Only the raw dot products of a
// large call are one batched GEMM over every slice first (at::matmul on the same strided views): a dot product per
// key ends in a horizontal sum, which costs more than the product itself at D = 32 and made a step at 4,096 tokens
// compute-bound; a GEMM has none. The value sum takes up to four rows of a slice per pass over the values (gMGK
// folds its query heads into rows), so each value is read once per four rows, in four times the independent FMAs.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

template <typename T>
using Vec = at::vec::Vectorized<T>;

template <typename T>
inline Vec<T> vexp(const Vec<T>& x) { return x.exp(); }
template <>
inline Vec<float> vexp<float>(const Vec<float>& x) { return x.exp_u20(); }

template <typename T>
inline T hsum(const Vec<T>& x) {
  return at::vec::vec_reduce_all<T>([](const Vec<T>& a, const Vec<T>& b) { return a + b; }, x);
}

// Four dot products of q (n numbers) with rows k0..k3: four accumulators side by side hide the FMA latency.
template <typename T>
inline void dot4(const T* q, const T* k0, const T* k1, const T* k2, const T* k3, int64_t n, T* out) {
  const int64_t W = Vec<T>::size();
  Vec<T> a0(T(0)), a1(T(0)), a2(T(0)), a3(T(0));
  int64_t d = 0;
  for (; d + W <= n; d += W) {
    const Vec<T> x = Vec<T>::loadu(q + d);
    a0 = at::vec::fmadd(x, Vec<T>::loadu(k0 + d), a0);
    a1 = at::vec::fmadd(x, Vec<T>::loadu(k1 + d), a1);
    a2 = at::vec::fmadd(x, Vec<T>::loadu(k2 + d), a2);
    a3 = at::vec::fmadd(x, Vec<T>::loadu(k3 + d), a3);
  }
  T s0 = hsum(a0), s1 = hsum(a1), s2 = hsum(a2), s3 = hsum(a3);
  for (; d < n; ++d) {
    s0 += q[d] * k0[d];
    s1 += q[d] * k1[d];
    s2 += q[d] * k2[d];
    s3 += q[d] * k3[d];
  }
  out[0] = s0; out[1] = s1; out[2] = s2; out[3] = s3;
}

template <typename T>
inline T dot1(const T* q, const T* k, int64_t n) {
  const int64_t W = Vec<T>::size();
  Vec<T> a(T(0));
  int64_t d = 0;
  for (; d + W <= n; d += W) a = at::vec::fmadd(Vec<T>::loadu(q + d), Vec<T>::loadu(k + d), a);
  T s = hsum(a);
  for (; d < n; ++d) s += q[d] * k[d];
  return s;
}

// dots[j] = q . k_j for j < S, rows of k at stride ks.
template <typename T>
inline void dots(const T* q, const T* k, int64_t ks, int64_t S, int64_t D, T* out) {
  int64_t j = 0;
  for (; j + 4 <= S; j += 4) dot4(q, k + j * ks, k + (j + 1) * ks, k + (j + 2) * ks, k + (j + 3) * ks, D, out + j);
  for (; j < S; ++j) out[j] = dot1(q, k + j * ks, D);
}

// out (NV vectors) = sum_j w[j] v_j over S rows of v at stride vs: the accumulators live in registers.
template <typename T, int NV>
inline void weighted_rows(const T* v, int64_t vs, const T* w, int64_t S, T* out) {
  const int64_t W = Vec<T>::size();
  Vec<T> acc[NV];
  for (int c = 0; c < NV; ++c) acc[c] = Vec<T>(T(0));
  for (int64_t j = 0; j < S; ++j) {
    const Vec<T> wj(w[j]);
    const T* row = v + j * vs;
    for (int c = 0; c < NV; ++c) acc[c] = at::vec::fmadd(wj, Vec<T>::loadu(row + c * W), acc[c]);
  }
  for (int c = 0; c < NV; ++c) acc[c].store(out + c * W);
}

// out[0:Dv] = sum_j w[j] v_j, in column chunks of at most 8 vectors (any Dv).
template <typename T>
void weighted_sum(const T* v, int64_t vs, const T* w, int64_t S, int64_t Dv, T* out) {
  const int64_t W = Vec<T>::size();
  int64_t c0 = 0;
  for (; c0 + 8 * W <= Dv; c0 += 8 * W) weighted_rows<T, 8>(v + c0, vs, w, S, out + c0);
  switch ((Dv - c0) / W) {
    case 7: weighted_rows<T, 7>(v + c0, vs, w, S, out + c0); break;
    case 6: weighted_rows<T, 6>(v + c0, vs, w, S, out + c0); break;
    case 5: weighted_rows<T, 5>(v + c0, vs, w, S, out + c0); break;
    case 4: weighted_rows<T, 4>(v + c0, vs, w, S, out + c0); break;
    case 3: weighted_rows<T, 3>(v + c0, vs, w, S, out + c0); break;
    case 2: weighted_rows<T, 2>(v + c0, vs, w, S, out + c0); break;
    case 1: weighted_rows<T, 1>(v + c0, vs, w, S, out + c0); break;
    default: break;
  }
  c0 += ((Dv - c0) / W) * W;
  for (int64_t c = c0; c < Dv; ++c) {
    T acc = 0;
    for (int64_t j = 0; j < S; ++j) acc += w[j] * v[j * vs + c];
    out[c] = acc;
  }
}

// out_i (NV vectors each, i < R) = sum_j w_i[j] v_j: R rows of weights (at stride ws) against one pass over v.
template <typename T, int NV, int R>
inline void weighted_rows_multi(const T* v, int64_t vs, const T* w, int64_t ws, int64_t S, T* out, int64_t os) {
  const int64_t W = Vec<T>::size();
  Vec<T> acc[R][NV];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < NV; ++c) acc[i][c] = Vec<T>(T(0));
  for (int64_t j = 0; j < S; ++j) {
    const T* row = v + j * vs;
    Vec<T> x[NV];
    for (int c = 0; c < NV; ++c) x[c] = Vec<T>::loadu(row + c * W);
    for (int i = 0; i < R; ++i) {
      const Vec<T> wij(w[i * ws + j]);
      for (int c = 0; c < NV; ++c) acc[i][c] = at::vec::fmadd(wij, x[c], acc[i][c]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < NV; ++c) acc[i][c].store(out + i * os + c * W);
}

// out_i[0:Dv] = sum_j w_i[j] v_j for R <= 4 rows (weights at stride ws, outputs at stride os): columns in chunks of
// two vectors over all R rows at once, the rest (and any R < 4 remainder of columns) by weighted_sum per row.
template <typename T, int R>
void weighted_sum_rows(const T* v, int64_t vs, const T* w, int64_t ws, int64_t S, int64_t Dv, T* out, int64_t os) {
  const int64_t W = Vec<T>::size();
  int64_t c0 = 0;
  for (; c0 + 2 * W <= Dv; c0 += 2 * W) weighted_rows_multi<T, 2, R>(v + c0, vs, w, ws, S, out + c0, os);
  if (c0 + W <= Dv) {
    weighted_rows_multi<T, 1, R>(v + c0, vs, w, ws, S, out + c0, os);
    c0 += W;
  }
  for (int64_t c = c0; c < Dv; ++c)
    for (int i = 0; i < R; ++i) {
      T acc = 0;
      for (int64_t j = 0; j < S; ++j) acc += w[i * ws + j] * v[j * vs + c];
      out[i * os + c] = acc;
    }
}

template <typename T>
T* scratch(size_t n) {
  thread_local std::vector<T> buffer;
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

// max that keeps a NaN (std::max would drop it and hide a NaN score).
template <typename T>
inline T nanmax(T a, T b) { return (a > b || std::isnan(a)) ? a : b; }

template <typename T>
struct Step {
  int64_t B, H, L, S, D, Dv, M, Mk;
  int64_t period;  // the new tokens of a query head: folded row l is query l % period (L when nothing is folded)
  const T* q;  // (B, H, L, D) contiguous
  const T* k; int64_t k_b, k_h, k_r, k_j;  // (B, H, Mk, S, D), last dim contiguous
  const T* scale;  // (H, M) or nullptr (1)
  const T* bias; int64_t b_b, b_h, b_r;  // (B, H, M, S), last dim contiguous
  const T* rowbias;  // (B, H, M, L) contiguous, or nullptr
  const T* v; int64_t v_b, v_h, v_j;  // (B, H, S, Dv), last dim contiguous
  const uint8_t* valid; int64_t valid_b;  // (B, S), last dim contiguous, or nullptr
  bool causal, hard;
  T* out;  // (B, H, L, Dv) contiguous
  const T* raw = nullptr;  // (B, H, Mk, L, S) contiguous: the dot products made ahead by one GEMM, or nullptr
};

// One slice (b, h): scores of its L queries (L x M x S) into sc, then the weights and the value sum; sc holds
// L * M * S + L numbers (the last L: each row's sum of weights).
// q: the slice's L queries (L, D); rb: its row terms (M, L) or nullptr.
template <typename T>
void slice(const Step<T>& p, int64_t b, int64_t h, T* sc, const T* q, const T* rb) {
  const T ninf = -std::numeric_limits<T>::infinity();
  const int64_t L = p.L, S = p.S, M = p.M, W = Vec<T>::size();
  const T* keys = p.k + b * p.k_b + h * p.k_h;
  const T* bias = p.bias + b * p.b_b + h * p.b_h;
  const T* v = p.v + b * p.v_b + h * p.v_h;
  const uint8_t* valid = p.valid ? p.valid + b * p.valid_b : nullptr;
  T* out = p.out + (b * p.H + h) * L * p.Dv;
  const T* raw_slice = p.raw ? p.raw + (b * p.H + h) * p.Mk * L * S : nullptr;
  // raw dot products: made ahead (raw_slice), or (L, Mk, S) at the front of sc, finished in place into (L, M, S)
  if (!raw_slice)
    for (int64_t l = 0; l < L; ++l)
      for (int64_t r = 0; r < p.Mk; ++r) dots(q + l * p.D, keys + r * p.k_r, p.k_j, S, p.D, sc + (l * M + r) * S);
  T* totals = sc + L * M * S;  // each row's sum of weights; 0 marks a row with no visible key
  for (int64_t l = 0; l < L; ++l) {
    T* row = sc + l * M * S;
    const int64_t lq = l % p.period;
    const int64_t visible = p.causal ? std::min<int64_t>(S, std::max<int64_t>(0, lq + S - p.period + 1)) : S;
    Vec<T> vmax(ninf);
    T mx = ninf;
    for (int64_t r = M - 1; r >= 0; --r) {  // from the last component: sMGK's raw dots sit in component 0
      const int64_t rk = p.Mk == 1 ? 0 : r;
      const T* raw = raw_slice ? raw_slice + (rk * L + l) * S : row + rk * S;
      T* s = row + r * S;
      const Vec<T> vscale(p.scale ? p.scale[h * M + r] : T(1)), vrb(rb ? rb[r * L + l] : T(0));
      const T* br = bias + r * p.b_r;
      int64_t j = 0;
      if (!valid) {  // the scores and their running maximum (at::vec::maximum keeps a NaN, as nanmax)
        for (; j + W <= visible; j += W) {
          const Vec<T> x = at::vec::fmadd(Vec<T>::loadu(raw + j), vscale, Vec<T>::loadu(br + j) + vrb);
          x.store(s + j);
          vmax = at::vec::maximum(vmax, x);
        }
      } else {
        for (; j + W <= visible; j += W)
          at::vec::fmadd(Vec<T>::loadu(raw + j), vscale, Vec<T>::loadu(br + j) + vrb).store(s + j);
      }
      const T sc1 = p.scale ? p.scale[h * M + r] : T(1), rb1 = rb ? rb[r * L + l] : T(0);
      for (; j < visible; ++j) s[j] = raw[j] * sc1 + br[j] + rb1;
      for (j = visible; j < S; ++j) s[j] = ninf;
      if (valid) {
        for (j = 0; j < visible; ++j) {
          if (!valid[j]) s[j] = ninf;
          mx = nanmax(mx, s[j]);
        }
      } else {
        for (j = (visible / W) * W; j < visible; ++j) mx = nanmax(mx, s[j]);
      }
    }
    if (!valid) {
      T lanes[Vec<T>::size()];
      vmax.store(lanes);
      for (int64_t i = 0; i < W; ++i) mx = nanmax(mx, lanes[i]);
    }
    if (mx == ninf) {  // no visible key: a zero row (its value sum, read from its own scores, is overwritten below)
      totals[l] = T(0);
      continue;
    }
    // the weights A_lj (unnormalised) into the row's first S numbers
    const Vec<T> vmx(mx);
    T total = 0;
    Vec<T> vtotal(T(0));
    int64_t j = 0;
    for (; j + W <= S; j += W) {
      Vec<T> w;
      if (p.hard) {
        Vec<T> best = Vec<T>::loadu(row + j);
        for (int64_t r = 1; r < M; ++r) best = at::vec::maximum(best, Vec<T>::loadu(row + r * S + j));
        w = vexp<T>(best - vmx);
      } else {
        w = vexp<T>(Vec<T>::loadu(row + j) - vmx);
        for (int64_t r = 1; r < M; ++r) w = w + vexp<T>(Vec<T>::loadu(row + r * S + j) - vmx);
      }
      w.store(row + j);
      vtotal = vtotal + w;
    }
    total = hsum(vtotal);
    for (; j < S; ++j) {
      T w;
      if (p.hard) {
        T best = row[j];
        for (int64_t r = 1; r < M; ++r) best = nanmax(best, row[r * S + j]);
        w = std::exp(best - mx);
      } else {
        w = std::exp(row[j] - mx);
        for (int64_t r = 1; r < M; ++r) w += std::exp(row[r * S + j] - mx);
      }
      row[j] = w;
      total += w;
    }
    totals[l] = total;
  }
  // the value sums, up to four rows per pass over the values (rows at stride M S in sc)
  const int64_t ws = M * S, Dv = p.Dv;
  int64_t l = 0;
  for (; l + 4 <= L; l += 4) weighted_sum_rows<T, 4>(v, p.v_j, sc + l * ws, ws, S, Dv, out + l * Dv, Dv);
  switch (L - l) {
    case 3: weighted_sum_rows<T, 3>(v, p.v_j, sc + l * ws, ws, S, Dv, out + l * Dv, Dv); break;
    case 2: weighted_sum_rows<T, 2>(v, p.v_j, sc + l * ws, ws, S, Dv, out + l * Dv, Dv); break;
    case 1: weighted_sum(v, p.v_j, sc + l * ws, S, Dv, out + l * Dv); break;
    default: break;
  }
  for (l = 0; l < L; ++l) {
    T* o = out + l * Dv;
    if (totals[l] == T(0)) {
      for (int64_t c = 0; c < Dv; ++c) o[c] = T(0);
      continue;
    }
    const T inv = T(1) / totals[l];
    for (int64_t c = 0; c < Dv; ++c) o[c] *= inv;
  }
}

// The raw dot products of every slice in one batched GEMM, when the call is large enough for it to pay and has
// several query rows a slice (a GEMM's fixed cost is a few microseconds; with one row it is a batched GEMV, which
// measured 1.3-1.5x slower than the dot loop for MGK-4's step at batch 1 and 1,024-4,096 tokens):
// q (B, H, L, D) against keys (B, H, Mk, S, D) -> (B, H, Mk, L, S) contiguous, or an undefined tensor.
torch::Tensor raw_dots(const torch::Tensor& q, const torch::Tensor& keys) {
  const int64_t L = q.size(2), Mk = keys.size(2), S = keys.size(3);
  if (L < 2 || L * Mk * S < 2048) return torch::Tensor();
  return at::matmul(q.unsqueeze(2), keys.transpose(-1, -2)).contiguous();
}

void check_rows(const torch::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got ", t.dim());
  TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, name, " must be contiguous in its last dimension");
}

}  // namespace

// q (B, H, L, D) contiguous; keys (B, H, Mk, S, D) with Mk = M or 1; scale (H, M) contiguous or empty; bias
// (B, H, M, S); rowbias (B, H, M, L) contiguous or empty; v (B, H, S, Dv); valid (B, S) bool or empty. keys, bias,
// v and valid may be strided views (last dimension contiguous). period: the causal alignment's period along the L
// rows (L, or the new tokens of each folded query head; divides L). -> (B, H, L, Dv).
torch::Tensor mixture_decode(torch::Tensor q, torch::Tensor keys, torch::Tensor scale, torch::Tensor bias,
                             torch::Tensor rowbias, torch::Tensor v, torch::Tensor valid, bool causal, bool hard,
                             int64_t period) {
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous(), "q must be a contiguous (B, H, L, D) tensor");
  check_rows(keys, "keys", 5);
  check_rows(bias, "bias", 4);
  check_rows(v, "v", 4);
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3);
  const int64_t M = bias.size(2), Mk = keys.size(2), S = keys.size(3), Dv = v.size(3);
  TORCH_CHECK(Mk == M || Mk == 1, "keys must hold M or 1 keys per position");
  TORCH_CHECK(L == 0 || (period >= 1 && L % period == 0), "period must divide the query rows L");
  TORCH_CHECK(keys.size(0) == B && keys.size(1) == H && keys.size(4) == D, "keys do not match q");
  TORCH_CHECK(bias.size(0) == B && bias.size(1) == H && bias.size(3) == S, "bias does not match keys");
  TORCH_CHECK(v.size(0) == B && v.size(1) == H && v.size(2) == S, "v does not match keys");
  for (const auto* t : {&keys, &bias, &v})
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "keys, bias and v must have q's dtype");
  const bool has_scale = scale.numel() > 0, has_rb = rowbias.numel() > 0, has_valid = valid.numel() > 0;
  if (has_scale)
    TORCH_CHECK(scale.is_contiguous() && scale.dim() == 2 && scale.size(0) == H && scale.size(1) == M &&
                scale.scalar_type() == q.scalar_type(), "scale must be a contiguous (H, M) tensor of q's dtype");
  if (has_rb)
    TORCH_CHECK(rowbias.is_contiguous() && rowbias.dim() == 4 && rowbias.size(0) == B && rowbias.size(1) == H &&
                rowbias.size(2) == M && rowbias.size(3) == L && rowbias.scalar_type() == q.scalar_type(),
                "rowbias must be a contiguous (B, H, M, L) tensor of q's dtype");
  if (has_valid) {
    check_rows(valid, "valid", 2);
    TORCH_CHECK(valid.scalar_type() == at::kBool && valid.size(0) == B && valid.size(1) == S,
                "valid must be a bool (B, S) tensor");
  }
  auto out = torch::empty({B, H, L, Dv}, q.options());
  if (out.numel() == 0) return out;
  if (S == 0) return out.zero_();
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "mixture_decode", [&] {
    Step<scalar_t> p{B, H, L, S, D, Dv, M, Mk, period,
                     q.data_ptr<scalar_t>(),
                     keys.data_ptr<scalar_t>(), keys.stride(0), keys.stride(1), keys.stride(2), keys.stride(3),
                     has_scale ? scale.data_ptr<scalar_t>() : nullptr,
                     bias.data_ptr<scalar_t>(), bias.stride(0), bias.stride(1), bias.stride(2),
                     has_rb ? rowbias.data_ptr<scalar_t>() : nullptr,
                     v.data_ptr<scalar_t>(), v.stride(0), v.stride(1), v.stride(2),
                     has_valid ? reinterpret_cast<const uint8_t*>(valid.data_ptr<bool>()) : nullptr,
                     has_valid ? valid.stride(0) : 0,
                     causal, hard, out.data_ptr<scalar_t>()};
    const torch::Tensor raw = raw_dots(q, keys);
    if (raw.defined()) p.raw = raw.data_ptr<scalar_t>();
    // small steps on the calling thread: waking the pool costs more than they do
    const int64_t grain = B * H * L * M * S * (D + Dv) < (int64_t(1) << 16) ? B * H : 1;
    at::parallel_for(0, B * H, grain, [&](int64_t begin, int64_t end) {
      scalar_t* sc = scratch<scalar_t>(static_cast<size_t>(L * M * S + L));
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / H, h = i % H;
        slice(p, b, h, sc, p.q + i * L * D, p.rowbias ? p.rowbias + i * M * L : nullptr);
      }
    });
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// The whole step in one call: the L new tokens' entries written into the cache's buffers at slots [t, t + L), then
// the L new queries attended over slots [0, t + L). The entries (MGK: keys[r] = (k_r - c) / s_r; sMGK: keys =
// k - c; and every bias_r) are made by the caller, in PyTorch, by the one formula (mgk_cache.py's _entries through
// _mixture_terms.key_bias): this kernel copies them and never computes a per-key term. Per slice (b, h) it makes
// the query's own terms, with c the centre and 1/s_r the inverse variance of component r (mgk_cache.py,
// _query_terms):
//
//   queries q~ = q - c; row term[r] = -(q~ . mu_r) / s_r - |mu_r|^2 / (2 s_r)   (sMGK)
//                                      - |q~|^2 / (2 s_r)                         (when the variances differ)
//
// Writing and reading in the same call saves the copies into the buffers and the query terms' small PyTorch calls
// (at batch 1 a step's per-call overhead is the cost to cut).
namespace {

template <typename T>
struct Write {
  const T* k; int64_t k_b, k_h, k_r, k_l;  // (B, H, Mk, L, D) new key entries, last dim contiguous
  const T* bn; int64_t bn_b, bn_h, bn_r;  // (B, H, M, L) new bias entries, last dim contiguous
  const T* vn; int64_t vn_b, vn_h, vn_l;  // (B, H, L, Dv) new values, last dim contiguous
  const T* c;  // (B, H, D) contiguous centre
  const T* inv; int64_t inv_h, inv_r;  // inverse variances at h * inv_h + r * inv_r (0 where shared)
  const T* mu;  // (M, H, D) contiguous shifts, or nullptr (MGK)
  bool qnorm;
  T* kb; int64_t kb_b, kb_h, kb_r, kb_j;  // key buffer (B, H, Mk, T, D)
  T* bb; int64_t bb_b, bb_h, bb_r;  // bias buffer (B, H, M, T)
  T* vb; int64_t vb_b, vb_h, vb_j;  // value buffer (B, H, T, Dv)
  int64_t t;  // first slot written
};

template <typename T>
void write_and_terms(const Step<T>& p, const Write<T>& w, int64_t b, int64_t h, T* qc, T* rb) {
  const int64_t L = p.L, D = p.D, M = p.M;
  const T* c = w.c + (b * p.H + h) * D;
  const T* invh = w.inv + h * w.inv_h;
  auto inv = [&](int64_t r) { return invh[r * w.inv_r]; };
  for (int64_t l = 0; l < p.period; ++l) {  // the new tokens' entries, copied (once per group: rows are folded)
    for (int64_t r = 0; r < p.Mk; ++r) {
      const T* k = w.k + b * w.k_b + h * w.k_h + r * w.k_r + l * w.k_l;
      T* dst = w.kb + b * w.kb_b + h * w.kb_h + r * w.kb_r + (w.t + l) * w.kb_j;
      for (int64_t d = 0; d < D; ++d) dst[d] = k[d];
    }
    for (int64_t r = 0; r < M; ++r)
      w.bb[b * w.bb_b + h * w.bb_h + r * w.bb_r + w.t + l] = w.bn[b * w.bn_b + h * w.bn_h + r * w.bn_r + l];
    const T* vn = w.vn + b * w.vn_b + h * w.vn_h + l * w.vn_l;
    T* vd = w.vb + b * w.vb_b + h * w.vb_h + (w.t + l) * w.vb_j;
    for (int64_t d = 0; d < p.Dv; ++d) vd[d] = vn[d];
  }
  for (int64_t l = 0; l < L; ++l) {  // every (folded) query row and its row terms
    const T* q = p.q + ((b * p.H + h) * L + l) * D;
    T qq = 0;
    for (int64_t d = 0; d < D; ++d) {
      qc[l * D + d] = q[d] - c[d];
      qq += qc[l * D + d] * qc[l * D + d];
    }
    if (rb) {
      for (int64_t r = 0; r < M; ++r) {
        T term = w.qnorm ? -qq * inv(r) * T(0.5) : T(0);
        if (w.mu) {
          const T* mu = w.mu + (r * p.H + h) * D;
          T qm = 0, mm = 0;
          for (int64_t d = 0; d < D; ++d) {
            qm += qc[l * D + d] * mu[d];
            mm += mu[d] * mu[d];
          }
          term -= (qm + mm * T(0.5)) * inv(r);
        }
        rb[r * L + l] = term;
      }
    }
  }
}

}  // namespace

// q (B, H, L, D) contiguous, uncentred; key_new (B, H, Mk, L, D) and bias_new (B, H, M, L) the new tokens' entries
// (mgk_cache.py's _entries) and value_new (B, H, L, Dv), last dims contiguous; centre (B, H, D) contiguous; inv_s2
// the inverse variances, one value, (M,) or (H, M), contiguous; shifts (M, H, D) contiguous or empty (MGK); the
// cache's buffers keys (B, H, Mk, T, D), bias (B, H, M, T), values (B, H, T, Dv) (last dims contiguous) with room
// for slots [t, t + L); valid (B, t + L) bool or empty; one dtype. Grouped keys: H is the key groups G and q holds
// the R = rows / L query heads of each group folded into its rows, (B, G, R L, D), L = key_new's new tokens. The
// caller (mgk_cache_step) has checked every operand and names a wrong one; the checks here only keep the kernel's
// memory accesses in bounds. -> (B, H, rows, Dv).
torch::Tensor mixture_decode_step(torch::Tensor q, torch::Tensor key_new, torch::Tensor bias_new,
                                  torch::Tensor value_new, torch::Tensor centre, torch::Tensor inv_s2,
                                  torch::Tensor shifts, bool qnorm, torch::Tensor keys_buf, torch::Tensor bias_buf,
                                  torch::Tensor values_buf, torch::Tensor valid, int64_t t, bool hard) {
  const bool shifted = shifts.numel() > 0, has_valid = valid.numel() > 0;
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous(), "query must be a contiguous (B, H, L, D) tensor");
  check_rows(key_new, "key", 5);
  check_rows(bias_new, "key_bias entries", 4);
  check_rows(value_new, "value", 4);
  check_rows(keys_buf, "keys", 5);
  check_rows(bias_buf, "key_bias", 4);
  check_rows(values_buf, "values", 4);
  const int64_t B = q.size(0), H = q.size(1), rows = q.size(2), D = q.size(3), L = key_new.size(3);
  const int64_t M = bias_buf.size(2), Mk = keys_buf.size(2), cap = keys_buf.size(3), Dv = values_buf.size(3);
  TORCH_CHECK(L == 0 ? rows == 0 : rows % L == 0, "the query rows must be the new tokens of whole query heads");
  for (const auto* x : {&key_new, &bias_new, &value_new, &keys_buf, &bias_buf, &values_buf})
    TORCH_CHECK(x->size(0) == B && x->size(1) == H && x->scalar_type() == q.scalar_type(),
                "every operand of the step must have query's batch size, heads and dtype");
  TORCH_CHECK(key_new.size(2) == Mk && key_new.size(3) == L && key_new.size(4) == D && keys_buf.size(4) == D &&
              bias_new.size(2) == M && bias_new.size(3) == L && value_new.size(2) == L &&
              value_new.size(3) == Dv && bias_buf.size(3) == cap && values_buf.size(2) == cap &&
              (Mk == M || Mk == 1) && M >= 1, "the step's operands do not match each other");
  const int64_t S = t + L;
  TORCH_CHECK(t >= 0 && S <= cap, "slot must be in [0, T - L] = [0, ", cap - L, "], got ", t);
  TORCH_CHECK(centre.dim() == 3 && centre.size(0) == B && centre.size(1) == H && centre.size(2) == D &&
              centre.is_contiguous() && centre.scalar_type() == q.scalar_type(),
              "centre must be a contiguous (B, H, D) tensor of query's dtype");
  const int64_t nv = inv_s2.numel();
  const bool per_head = inv_s2.dim() == 2 && inv_s2.size(0) == H && inv_s2.size(1) == M && H > 1;
  TORCH_CHECK(inv_s2.is_contiguous() && inv_s2.scalar_type() == q.scalar_type() &&
              (nv == 1 || (nv == M && inv_s2.size(-1) == M) || per_head),
              "the inverse variances must be one value, (M,) or (H, M)");
  if (shifted)
    TORCH_CHECK(shifts.is_contiguous() && shifts.dim() == 3 && shifts.size(0) == M && shifts.size(1) == H &&
                shifts.size(2) == D && shifts.scalar_type() == q.scalar_type(),
                "shifts must be a contiguous (M, H, D) tensor of query's dtype");
  if (has_valid) {
    check_rows(valid, "key_valid", 2);
    TORCH_CHECK(valid.scalar_type() == at::kBool && valid.size(0) == B && valid.size(1) == S,
                "key_valid must be a bool tensor (B, slot + L)");
  }
  auto out = torch::empty({B, H, rows, Dv}, q.options());
  if (B * H * rows == 0) return out;
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "mixture_decode_step", [&] {
    using T = scalar_t;
    const T* inv = inv_s2.data_ptr<T>();
    auto kb = keys_buf.narrow(3, 0, S), bb = bias_buf.narrow(3, 0, S), vb = values_buf.narrow(2, 0, S);
    Step<T> p{B, H, rows, S, D, Dv, M, Mk, L,
              q.data_ptr<T>(),
              kb.data_ptr<T>(), kb.stride(0), kb.stride(1), kb.stride(2), kb.stride(3),
              nullptr,  // MGK's keys are scaled when made; sMGK's scale comes below
              bb.data_ptr<T>(), bb.stride(0), bb.stride(1), bb.stride(2),
              nullptr,
              vb.data_ptr<T>(), vb.stride(0), vb.stride(1), vb.stride(2),
              has_valid ? reinterpret_cast<const uint8_t*>(valid.data_ptr<bool>()) : nullptr,
              has_valid ? valid.stride(0) : 0,
              L > 1, hard, out.data_ptr<T>()};
    // sMGK's stored keys are unscaled: the kernel scales their dot products by 1 / s_r, per head
    std::vector<T> scale;
    if (shifted) {
      scale.resize(H * M);
      for (int64_t h = 0; h < H; ++h)
        for (int64_t r = 0; r < M; ++r) scale[h * M + r] = inv[nv == 1 ? 0 : per_head ? h * M + r : r];
      p.scale = scale.data();
    }
    Write<T> w{key_new.data_ptr<T>(), key_new.stride(0), key_new.stride(1), key_new.stride(2), key_new.stride(3),
               bias_new.data_ptr<T>(), bias_new.stride(0), bias_new.stride(1), bias_new.stride(2),
               value_new.data_ptr<T>(), value_new.stride(0), value_new.stride(1), value_new.stride(2),
               centre.data_ptr<T>(), inv, per_head ? M : 0, nv == 1 ? 0 : 1,
               shifted ? shifts.data_ptr<T>() : nullptr, qnorm,
               kb.data_ptr<T>(), kb.stride(0), kb.stride(1), kb.stride(2), kb.stride(3),
               bb.data_ptr<T>(), bb.stride(0), bb.stride(1), bb.stride(2),
               vb.data_ptr<T>(), vb.stride(0), vb.stride(1), vb.stride(2), t};
    const bool terms = shifted || qnorm;
    const int64_t grain = B * H * rows * M * S * (D + Dv) < (int64_t(1) << 16) ? B * H : 1;
    // first every slice's writes, centred queries and row terms (the GEMM of the dot products reads the new keys)
    auto qc = torch::empty({B, H, rows, D}, q.options());
    auto rb = terms ? torch::empty({B, H, M, rows}, q.options()) : torch::Tensor();
    T* qc_all = qc.data_ptr<T>();
    T* rb_all = terms ? rb.data_ptr<T>() : nullptr;
    at::parallel_for(0, B * H, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        write_and_terms(p, w, i / H, i % H, qc_all + i * rows * D, rb_all ? rb_all + i * M * rows : nullptr);
    });
    const torch::Tensor raw = raw_dots(qc, kb);
    if (raw.defined()) p.raw = raw.data_ptr<T>();
    at::parallel_for(0, B * H, grain, [&](int64_t begin, int64_t end) {
      T* sc = scratch<T>(static_cast<size_t>(rows * M * S + rows));
      for (int64_t i = begin; i < end; ++i)
        slice(p, i / H, i % H, sc, qc_all + i * rows * D, rb_all ? rb_all + i * M * rows : nullptr);
    });
  });
  return out;
}

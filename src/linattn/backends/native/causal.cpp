// Linear attention's native forward (no gradients): causal token by token with the state in cache, and
// non-causal in two register-blocked passes (at the end of the kernels below).
//
// On a CPU with a few cores the chunked forms spend most of their time in passes over whole (N, F) tensors and in
// small batched products; the recurrence itself is small (an F x Dv state, 16 KiB at 64 x 64 fp32) and stays in
// the first-level cache when one thread carries one (batch, head) row through all its tokens. Each call here
// continues the state it is given over a block of tokens (the Python side, linattn/backends/native/forms.py, makes
// the features of one block at a time in torch, so any feature map works and no (N, F) feature tensor is kept):
//
//   additive_block:  S <- S + phi(k_t) v_t^T,  z <- z + phi(k_t),  out_t = S^T phi(q_t) / max(phi(q_t).z + eps, m)
//                    (kinds/additive/forms/recurrent.py is the reference; unnormalised when asked)
//   delta_block:     S <- diag(a_t) S,  u = beta_t (v_t - S^T k_t),  S <- S + k_t u^T,  out_t = S^T q_t
//                    (kinds/delta/forms.py and kinds/kda/forms.py; a_t = exp(g_t), one g per token or per feature)
//
// and, beside the sparse exact cache (exact/forms/sparse_composed.py), its boundary decisions under the recall score
// (sparse_delta_decide) and its exact term (cache_exact); beside the window, its band's softmax average with the
// sinks (band_average), near the end of the file.
//
// The value rows are held in vectors of the build's register width (GCC's vector extension: 64 bytes where it
// targets AVX-512, 32 with AVX2, 16 otherwise; a vector wider than the target's registers has no machine mode, so
// GCC keeps it in memory and splits every operation: 10-25x slower on an AVX2 CPU). The Python side admits Dv in
// multiples of 64 bytes (16 fp32 or 8 fp64), at most 16 of them, and leaves other sizes to the torch forms. Rows (batch x
// heads) run in parallel in torch's OpenMP pool. Nothing here checks its inputs: the Python caller does, once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/python.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int kLaneBytes = 64, kRegisters = 32;
#elif defined(__AVX__)
constexpr int kLaneBytes = 32, kRegisters = 16;
#else
constexpr int kLaneBytes = 16, kRegisters = 16;
#endif
constexpr int kPerBlock = 64 / kLaneBytes;  // vectors in the 64 bytes the Python side counts Dv in

template <typename T>
struct Lanes {
  typedef T vec __attribute__((vector_size(kLaneBytes)));
  static constexpr int count = kLaneBytes / sizeof(T);
};
template <typename T>
using V_of = typename Lanes<T>::vec;

// a row-major (rows, tokens, width) view: x[r][t][i] at base + r * row + t * token + i
template <typename T>
struct View {
  T* base;
  int64_t row, token;
  T* at(int64_t r, int64_t t) const { return base + r * row + t * token; }
};

template <typename T>
View<T> view(const at::Tensor& x) {
  return {x.data_ptr<T>(), x.stride(0), x.stride(1)};
}

template <typename T, int NV>
void load_row(typename Lanes<T>::vec* out, const T* from) {
#pragma GCC unroll 16
  for (int j = 0; j < NV; ++j) std::memcpy(&out[j], from + j * Lanes<T>::count, sizeof(out[j]));
}

template <typename T, int NV>
void store_row(T* to, const typename Lanes<T>::vec* from, T factor) {
#pragma GCC unroll 16
  for (int j = 0; j < NV; ++j) {
    const typename Lanes<T>::vec scaled = from[j] * factor;
    std::memcpy(to + j * Lanes<T>::count, &scaled, sizeof(scaled));
  }
}

// 1 / max(den + eps, min_denom), a zero denominator dividing by 1 (kinds/additive/forms/_common.py, finalize)
template <typename T>
T inverse_denominator(T den, bool normalize, double eps, double min_denom, bool clamp) {
  if (!normalize) return T(1);
  den += static_cast<T>(eps);
  if (clamp && den < static_cast<T>(min_denom)) den = static_cast<T>(min_denom);
  return den == T(0) ? T(1) : T(1) / den;
}

// e^x for x <= 0, floored at the dtype's smallest normal number: the elu map's negative side
// (linattn/feature_maps/elementwise.py). Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, then a Taylor
// polynomial of r (degree 7 in fp32, 12 in fp64: truncation below half an ulp) and 2^n put in the exponent bits,
// in arithmetic the compiler vectorises. NaN stays NaN.
template <typename T>
struct ExpConstants;
template <>
struct ExpConstants<float> {
  using Bits = int32_t;
  static constexpr int degree = 7, mantissa = 23, bias = 127;
  static constexpr float low = -87.33654f;  // log of the smallest normal float
  static constexpr float tiny = 1.17549435e-38f;
};
template <>
struct ExpConstants<double> {
  using Bits = int64_t;
  static constexpr int degree = 12, mantissa = 52, bias = 1023;
  static constexpr double low = -708.3964185322641;
  static constexpr double tiny = 2.2250738585072014e-308;
};

// 1/i! for i = 0 ... 12, each a quotient of two exact doubles (rounded once)
constexpr double inverse_factorials[13] = {1.0, 1.0, 1.0 / 2, 1.0 / 6, 1.0 / 24, 1.0 / 120, 1.0 / 720,
                                           1.0 / 5040, 1.0 / 40320, 1.0 / 362880, 1.0 / 3628800,
                                           1.0 / 39916800, 1.0 / 479001600};

template <typename T, bool floored = true>
inline T exp_nonpositive(T x) {
  using C = ExpConstants<T>;
  using Bits = typename C::Bits;
  const T clipped = x < C::low ? C::low : x;  // false for NaN: NaN goes on
  // round to nearest by adding and removing 1.5 * 2^mantissa (no libm call, so the loop vectorises)
  const T shifter = T(1.5) * static_cast<T>(Bits(1) << C::mantissa);
  const T rounded = clipped * T(1.4426950408889634) + shifter;  // n + 1.5 * 2^mantissa, n in the low bits
  const T n = rounded - shifter;
  const T r = (clipped - n * T(0.693145751953125)) - n * T(1.4286068203094173e-06);
  // Horner's rule on the coefficients 1/i! (one fused multiply-add a degree; the nested form 1 + r/i (1 + ...)
  // took two operations a degree)
  T p = static_cast<T>(inverse_factorials[C::degree]);
#pragma GCC unroll 16
  for (int i = C::degree - 1; i >= 0; --i) p = p * r + static_cast<T>(inverse_factorials[i]);
  // 2^n with integer arithmetic on the bits (GCC and Clang; a memcpy here would stop vectorisation): n from the low
  // bits of `rounded` rather than a float-to-int conversion, which AVX2 lacks for fp64
  const Bits bits = (__builtin_bit_cast(Bits, rounded) - __builtin_bit_cast(Bits, shifter) + C::bias) << C::mantissa;
  const T e = p * __builtin_bit_cast(T, bits);
  const T unfloored = x <= C::low ? T(0) : e;  // below the smallest normal number: 0, as softmax's exp gives
  if (!floored) return unfloored;
  return unfloored < C::tiny ? C::tiny : unfloored;  // (two selects: GCC vectorised no loop over an || of them)
}

// phi(x) = elu(x) + 1 = e^{min(x, 0)} (floored) + max(x, 0) of one row, into `out`
template <typename T>
void elu_row(T* __restrict out, const T* __restrict x, int64_t width) {
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) {
    // NaN goes to the negative side (and stays NaN), as torch's clamp passes it on
    const T negative = x[i] > T(0) ? T(0) : x[i], positive = x[i] > T(0) ? x[i] : T(0);
    out[i] = exp_nonpositive(negative) + positive;
  }
}

template <typename T, int NV>
void additive(View<T> q_in, View<T> k_in, View<T> v, T* kv, T* k_sum, View<T> out, int64_t rows, int64_t n,
              int64_t features, bool normalize, double eps, double min_denom, bool clamp, bool elu) {
  using V = typename Lanes<T>::vec;
  constexpr int dv = NV * Lanes<T>::count;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<V> state(features * NV);
    // with `elu`, q_in and k_in are the raw rows: each token's features are made here, two tokens at a time
    std::vector<T> mapped(elu ? 4 * features : 0);
    T* mapped_p = mapped.data();
    auto qrow = [&](int64_t r, int64_t t, int slot) -> const T* {
      if (!elu) return q_in.at(r, t);
      elu_row(mapped_p + slot * features, q_in.at(r, t), features);
      return mapped_p + slot * features;
    };
    auto krow = [&](int64_t r, int64_t t, int slot) -> const T* {
      if (!elu) return k_in.at(r, t);
      elu_row(mapped_p + (2 + slot) * features, k_in.at(r, t), features);
      return mapped_p + (2 + slot) * features;
    };
    for (int64_t r = begin; r < end; ++r) {
      V* S = state.data();
      T* row_kv = kv + r * features * dv;
      T* z = k_sum + r * features;
      for (int64_t f = 0; f < features; ++f) load_row<T, NV>(S + f * NV, row_kv + f * dv);
      int64_t t = 0;
      for (; t + 1 < n; t += 2) {  // two tokens per pass over S: half the loads and stores of S per product
        const T *q1 = qrow(r, t, 0), *k1 = krow(r, t, 0), *q2 = qrow(r, t + 1, 1), *k2 = krow(r, t + 1, 1);
        V v1[NV], v2[NV], o1[NV], o2[NV];
        load_row<T, NV>(v1, v.at(r, t));
        load_row<T, NV>(v2, v.at(r, t + 1));
#pragma GCC unroll 16
        for (int j = 0; j < NV; ++j) o1[j] = o2[j] = V{};
        for (int64_t f = 0; f < features; ++f) {
          V* s = S + f * NV;
          const T a1 = k1[f], b1 = q1[f], a2 = k2[f], b2 = q2[f];
#pragma GCC unroll 16
          for (int j = 0; j < NV; ++j) {
            V x = s[j] + a1 * v1[j];
            o1[j] += b1 * x;
            x += a2 * v2[j];
            o2[j] += b2 * x;
            s[j] = x;
          }
        }
        T d1 = 0, d2 = 0;
        for (int64_t f = 0; f < features; ++f) {
          T sum = z[f] + k1[f];
          d1 += q1[f] * sum;
          sum += k2[f];
          d2 += q2[f] * sum;
          z[f] = sum;
        }
        store_row<T, NV>(out.at(r, t), o1, inverse_denominator(d1, normalize, eps, min_denom, clamp));
        store_row<T, NV>(out.at(r, t + 1), o2, inverse_denominator(d2, normalize, eps, min_denom, clamp));
      }
      if (t < n) {  // an odd last token
        const T *q1 = qrow(r, t, 0), *k1 = krow(r, t, 0);
        V v1[NV], o1[NV];
        load_row<T, NV>(v1, v.at(r, t));
#pragma GCC unroll 16
        for (int j = 0; j < NV; ++j) o1[j] = V{};
        for (int64_t f = 0; f < features; ++f) {
          V* s = S + f * NV;
          const T a1 = k1[f], b1 = q1[f];
#pragma GCC unroll 16
          for (int j = 0; j < NV; ++j) {
            s[j] += a1 * v1[j];
            o1[j] += b1 * s[j];
          }
        }
        T d1 = 0;
        for (int64_t f = 0; f < features; ++f) {
          z[f] += k1[f];
          d1 += q1[f] * z[f];
        }
        store_row<T, NV>(out.at(r, t), o1, inverse_denominator(d1, normalize, eps, min_denom, clamp));
      }
      for (int64_t f = 0; f < features; ++f) store_row<T, NV>(row_kv + f * dv, S + f * NV, T(1));
    }
  });
}

// the decay factors of token t: exp of its one log-gate (copied to every feature) or of its F log-gates
template <typename T>
void factors(T* out, const double* gate, int64_t gates, int64_t features) {
  if (gate == nullptr) {
    for (int64_t f = 0; f < features; ++f) out[f] = T(1);
  } else if (gates == 1) {
    const T a = static_cast<T>(std::exp(gate[0]));
    for (int64_t f = 0; f < features; ++f) out[f] = a;
  } else {
    // log-gates are <= 0 (checked in Python): the vectorised exp, in fp64 and rounded once to T
#pragma omp simd
    for (int64_t f = 0; f < features; ++f) out[f] = static_cast<T>(exp_nonpositive<double, false>(gate[f]));
  }
}

// a query or key row as the delta rule reads it, before its unit scale: mapped by elu + 1 into `into`, or the row
// itself
template <typename T>
const T* mapped_row(T* into, const T* row, int64_t features, bool elu) {
  if (!elu) return row;
  elu_row(into, row, features);
  return into;
}

// with `unit`, 1 / max(|row|, 1e-12) (linattn.features.unit_rows); else 1. The pass reads row · scale, formed in the
// loops that lay out its coefficients (no copy of the row and no pass that rescales it)
template <typename T>
T unit_scale(const T* row, int64_t features, bool unit) {
  if (!unit) return T(1);
  T norm = 0;
#pragma omp simd reduction(+ : norm)
  for (int64_t f = 0; f < features; ++f) norm += row[f] * row[f];
  norm = std::sqrt(norm);
  return T(1) / (norm > T(1e-12) ? norm : T(1e-12));
}

// value vectors of a strip of the delta pass: 3 accumulators each and 4 broadcasts in the registers
template <int NV>
constexpr int delta_strip() {
  return NV < kRegisters / 4 ? NV : kRegisters / 4;
}

// The delta rule over one work item: a row's value columns `column` … `column` + W·lanes − 1 (all of them with
// W = NV). The rule is independent across value columns (S^T k of a column reads that column alone), so a row can
// be cut into strips that run apart; each strip repeats the row's per-token work (the norms, the gates' factors).
// GATED: the state decays (a log-gate given); without one the decay's multiply is left out of the pass (a quarter
// of its arithmetic). READS: each token's query reads the state into `out` (without, the writes alone: q and out
// are not read).
template <typename T, int NV, int W, bool GATED, bool READS = true>
void delta_item(View<T> q, View<T> k, View<T> v, View<T> beta, const double* g, int64_t gate_token, int64_t gates,
                T* row_kv, View<T> out, int64_t r, int64_t column, int64_t n, int64_t features, bool elu, bool unit,
                V_of<T>* S, T* buffers) {
  using V = V_of<T>;
  constexpr int dv = NV * Lanes<T>::count, H = delta_strip<NV>();
  T *now = buffers, *next = buffers + features, *wk = buffers + 2 * features, *cf = buffers + 3 * features;
  T *rq = buffers + 4 * features, *query_buffer = buffers + 5 * features;
  T* key_buffers[2] = {buffers + 6 * features, buffers + 7 * features};
  for (int64_t f = 0; f < features; ++f) load_row<T, W>(S + f * W, row_kv + f * dv);
  const T* b = beta.at(r, 0);
  // S^T (a_0 * k_0) for the first token: each later one is summed in the pass before it
  V recalled[W];
#pragma GCC unroll 16
  for (int j = 0; j < W; ++j) recalled[j] = V{};
  factors(now, g, gates, features);
  const T* key = nullptr;  // token t's key row, mapped in the pass before (never for a token that writes nothing)
  T key_scale = 0;
  int slot = 0;
  if (n > 0 && b[0] != T(0)) {
    key = mapped_row(key_buffers[slot], k.at(r, 0), features, elu);
    key_scale = unit_scale(key, features, unit);
    for (int64_t f = 0; f < features; ++f) {
      const T c = now[f] * (key[f] * key_scale);
#pragma GCC unroll 16
      for (int j = 0; j < W; ++j) recalled[j] += c * S[f * W + j];
    }
  }
  for (int64_t t = 0; t < n; ++t) {
    const T strength = b[t * beta.token];
    const bool writes = strength != T(0);  // a masked token writes nothing (its key is never read)
    V u[W], o[W], ahead[W];
    if (writes) {
      V value[W];
      load_row<T, W>(value, v.at(r, t) + column);
#pragma GCC unroll 16
      for (int j = 0; j < W; ++j) u[j] = strength * (value[j] - recalled[j]);
    } else {
#pragma GCC unroll 16
      for (int j = 0; j < W; ++j) u[j] = V{};
    }
#pragma GCC unroll 16
    for (int j = 0; j < W; ++j) o[j] = ahead[j] = V{};
    // the next token's recall S_t^T (a_{t+1} * k_{t+1}) is summed in this token's pass over S
    const bool recalls = t + 1 < n && b[(t + 1) * beta.token] != T(0);
    if (t + 1 < n) factors(next, g != nullptr ? g + (t + 1) * gate_token : nullptr, gates, features);
    const T* following = nullptr;
    T following_scale = 0;
    if (recalls) {
      following = mapped_row(key_buffers[1 - slot], k.at(r, t + 1), features, elu);
      following_scale = unit_scale(following, features, unit);
    }
    if constexpr (READS) {
      const T* query = mapped_row(query_buffer, q.at(r, t), features, elu);
      const T query_scale = unit_scale(query, features, unit);
      for (int64_t f = 0; f < features; ++f) rq[f] = query[f] * query_scale;
    }
    // the pass's coefficients, so that it has no branch: a token that writes nothing has u = 0 and its key's row
    // zero, a recall not wanted its row zero
    if (writes) {
      for (int64_t f = 0; f < features; ++f) wk[f] = key[f] * key_scale;
    } else {
      for (int64_t f = 0; f < features; ++f) wk[f] = T(0);
    }
    if (recalls) {
      for (int64_t f = 0; f < features; ++f) cf[f] = next[f] * (following[f] * following_scale);
    } else {
      for (int64_t f = 0; f < features; ++f) cf[f] = T(0);
    }
    // the pass in strips of H value vectors, so that a strip's u, out and next-recall sums stay in registers
    for (int j0 = 0; j0 < W; j0 += H) {
      V uu[H], oo[H], aa[H];
#pragma GCC unroll 16
      for (int h = 0; h < H; ++h) { uu[h] = u[j0 + h]; oo[h] = aa[h] = V{}; }
      for (int64_t f = 0; f < features; ++f) {
        V* s = S + f * W + j0;
        const T a = now[f], w = wk[f], rd = READS ? rq[f] : T(0), c = cf[f];
#pragma GCC unroll 16
        for (int h = 0; h < H; ++h) {
          V x = GATED ? a * s[h] : s[h];
          x += w * uu[h];
          s[h] = x;
          if constexpr (READS) oo[h] += rd * x;
          aa[h] += c * x;
        }
      }
#pragma GCC unroll 16
      for (int h = 0; h < H; ++h) { o[j0 + h] = oo[h]; ahead[j0 + h] = aa[h]; }
    }
    if constexpr (READS) store_row<T, W>(out.at(r, t) + column, o, T(1));
#pragma GCC unroll 16
    for (int j = 0; j < W; ++j) recalled[j] = ahead[j];
    std::swap(now, next);
    key = following;
    key_scale = following_scale;
    slot = 1 - slot;
  }
  for (int64_t f = 0; f < features; ++f) store_row<T, W>(row_kv + f * dv, S + f * W, T(1));
}

// Whether the delta pass runs rows cut into strips: when that evens out the threads' work by more than the strips'
// repeated per-token work costs. That work, against a whole row's pass, is about 0.05 with one gate per token and
// 0.25 with one per feature at Dv = 64 fp32 on AVX2 (the exp of every feature's gate), and shrinks as 1 / Dv. Nine
// rows on two threads: 5 rows against 4.5 on the busier thread, so strips pay with a token gate and not with
// per-feature gates.
inline bool delta_in_strips(int64_t rows, int strips, int64_t dv, bool feature_gates) {
  const int64_t threads = at::get_num_threads();
  if (strips == 1 || threads == 1 || rows <= 0) return false;
  const double repeated = (feature_gates ? 0.25 : 0.05) * 64.0 / static_cast<double>(dv);
  const double whole = static_cast<double>((rows + threads - 1) / threads) * (1.0 + repeated);
  const double cut = static_cast<double>((rows * strips + threads - 1) / threads) * (1.0 / strips + repeated);
  return cut < whole;
}

template <typename T, int NV, bool GATED>
void delta(View<T> q, View<T> k, View<T> v, View<T> beta, const double* gate, int64_t gate_row, int64_t gate_token,
           int64_t gates, T* kv, View<T> out, int64_t rows, int64_t n, int64_t features, bool elu, bool unit) {
  constexpr int lanes = Lanes<T>::count, dv = NV * lanes, H = delta_strip<NV>(), strips = NV / H;
  static_assert(NV % H == 0, "the strips cover the value vectors");
  const auto run = [&](auto width) {
    constexpr int W = decltype(width)::value, pieces = NV / W;
    at::parallel_for(0, rows * pieces, 1, [&](int64_t begin, int64_t end) {
      std::vector<V_of<T>> state(features * W);
      std::vector<T> buffers(8 * features);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t r = item / pieces, column = (item % pieces) * W * lanes;
        delta_item<T, NV, W, GATED>(q, k, v, beta, gate != nullptr ? gate + r * gate_row : nullptr, gate_token,
                                    gates, kv + r * features * dv + column, out, r, column, n, features, elu, unit,
                                    state.data(), buffers.data());
      }
    });
  };
  if (delta_in_strips(rows, strips, dv, gates > 1)) {
    run(std::integral_constant<int, H>{});
  } else {
    run(std::integral_constant<int, NV>{});
  }
}

// Non-causal linear attention in two passes over the tokens (kinds/additive/forms/global.py is the reference):
//
//   accumulate:  S <- S + sum_t phi(k_t) v_t^T,  z <- z + sum_t phi(k_t)
//   read:        out_t = S^T phi(q_t) / max(phi(q_t).z + eps, m)   (unnormalised when asked)
//
// Both are register-blocked products with 24 vector accumulators (16 for the widest values): the accumulation takes
// a strip of 24/NV feature rows of S and adds one block of tokens' rank-1 terms to it (v_t loaded once per strip,
// phi(k_t) broadcast); the read takes 24/NV query tokens and sums the F rows of S (in the first-level cache) into
// them. A block of 64 keys'
// features (elu made here, or given) is read by every strip while it is in cache.
template <typename T, int NV, int FR, bool NEG = false>
inline void rank_strip(T* S, const T* k, int64_t k_token, const T* v, int64_t v_token, int64_t tokens) {
  using V = typename Lanes<T>::vec;
  constexpr int dv = NV * Lanes<T>::count;
  V acc[FR][NV];
#pragma GCC unroll 16
  for (int i = 0; i < FR; ++i) load_row<T, NV>(acc[i], S + i * dv);
  for (int64_t t = 0; t < tokens; ++t) {
    V x[NV];
    load_row<T, NV>(x, v + t * v_token);
    const T* kt = k + t * k_token;
#pragma GCC unroll 16
    for (int i = 0; i < FR; ++i) {
      const T a = NEG ? -kt[i] : kt[i];
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) acc[i][j] += a * x[j];
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < FR; ++i) store_row<T, NV>(S + i * dv, acc[i], T(1));
}

// rank_strip over the last `rest` (< FR) feature rows, compiled for each count
template <typename T, int NV, int FR, bool NEG = false>
inline void rank_rest(int rest, T* S, const T* k, int64_t k_token, const T* v, int64_t v_token, int64_t tokens) {
  if constexpr (FR > 1) {
    if (rest == FR - 1) {
      rank_strip<T, NV, FR - 1, NEG>(S, k, k_token, v, v_token, tokens);
    } else {
      rank_rest<T, NV, FR - 1, NEG>(rest, S, k, k_token, v, v_token, tokens);
    }
  }
}

// accumulators a strip or tile keeps: three quarters of the registers (24 of AVX-512's 32, 12 of AVX2's 16), at
// least one row
template <int NV>
constexpr int tile_rows() {
  return NV >= kRegisters * 3 / 4 ? 1 : kRegisters * 3 / 4 / NV;
}

// z += the sum of `tokens` rows of `features` entries (rows `token` apart): a vector of z at a time over the rows
template <typename T>
inline void add_rows(T* z, const T* rows, int64_t token, int64_t tokens, int64_t features) {
  using V = typename Lanes<T>::vec;
  constexpr int lanes = Lanes<T>::count;
  int64_t f = 0;
  for (; f + lanes <= features; f += lanes) {
    V sum;
    std::memcpy(&sum, z + f, sizeof(sum));
    for (int64_t t = 0; t < tokens; ++t) {
      V x;
      std::memcpy(&x, rows + t * token + f, sizeof(x));
      sum += x;
    }
    std::memcpy(z + f, &sum, sizeof(sum));
  }
  for (; f < features; ++f)
    for (int64_t t = 0; t < tokens; ++t) z[f] += rows[t * token + f];
}

template <typename T, int NV>
void accumulate(View<T> k_in, View<T> v, T* kv, T* k_sum, int64_t rows, int64_t n, int64_t features, bool elu) {
  constexpr int dv = NV * Lanes<T>::count;
  constexpr int FR = tile_rows<NV>();
  constexpr int64_t TB = 64;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> mapped(elu ? TB * features : 0);
    for (int64_t r = begin; r < end; ++r) {
      T* S = kv + r * features * dv;
      T* z = k_sum + r * features;
      for (int64_t t0 = 0; t0 < n; t0 += TB) {
        const int64_t tokens = std::min(TB, n - t0);
        const T* keys = k_in.at(r, t0);
        int64_t k_token = k_in.token;
        if (elu) {
          for (int64_t t = 0; t < tokens; ++t) elu_row(mapped.data() + t * features, k_in.at(r, t0 + t), features);
          keys = mapped.data();
          k_token = features;
        }
        add_rows(z, keys, k_token, tokens, features);
        int64_t f0 = 0;
        for (; f0 + FR <= features; f0 += FR)
          rank_strip<T, NV, FR>(S + f0 * dv, keys + f0, k_token, v.at(r, t0), v.token, tokens);
        if (f0 < features)
          rank_rest<T, NV, FR>(static_cast<int>(features - f0), S + f0 * dv, keys + f0, k_token, v.at(r, t0),
                               v.token, tokens);
      }
    }
  });
}

// a . b over n entries: whole vectors, then the rest (an omp simd reduction here cost as much as the tile's product)
template <typename T>
inline T dot(const T* a, const T* b, int64_t n) {
  using V = typename Lanes<T>::vec;
  constexpr int lanes = Lanes<T>::count;
  V sum{};
  int64_t f = 0;
  for (; f + lanes <= n; f += lanes) {
    V x, y;
    std::memcpy(&x, a + f, sizeof(x));
    std::memcpy(&y, b + f, sizeof(y));
    sum += x * y;
  }
  T total = 0;
  for (int j = 0; j < lanes; ++j) total += sum[j];
  for (; f < n; ++f) total += a[f] * b[f];
  return total;
}

// acc[i] += sum_f rows[i][f] S[f] over `depth` rows of S (16 NV entries each, in the first-level cache): the
// register-blocked product of a tile of TQ rows (the non-causal read, the Hedgehog map's projection)
template <typename T, int NV, int TQ>
inline void tile_product(typename Lanes<T>::vec (&acc)[TQ][NV], const T* const* rows, const T* S, int64_t depth) {
  using V = typename Lanes<T>::vec;
  constexpr int width = NV * Lanes<T>::count;
  for (int64_t f = 0; f < depth; ++f) {
    V s[NV];
    load_row<T, NV>(s, S + f * width);
#pragma GCC unroll 16
    for (int i = 0; i < TQ; ++i) {
      const T a = rows[i][f];
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) acc[i][j] += a * s[j];
    }
  }
}

template <typename T, int NV, int TQ>
inline void read_tile(const T* const* q, const T* S, const T* z, T* const* out, int64_t features, bool normalize,
                      double eps, double min_denom, bool clamp) {
  using V = typename Lanes<T>::vec;
  V acc[TQ][NV];
#pragma GCC unroll 16
  for (int i = 0; i < TQ; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) acc[i][j] = V{};
  tile_product<T, NV, TQ>(acc, q, S, features);
  for (int i = 0; i < TQ; ++i) {
    store_row<T, NV>(out[i], acc[i], inverse_denominator(dot(q[i], z, features), normalize, eps, min_denom, clamp));
  }
}

template <typename T, int NV>
void read(View<T> q_in, const T* kv, const T* k_sum, View<T> out, int64_t rows, int64_t n, int64_t features,
          bool normalize, double eps, double min_denom, bool clamp, bool elu) {
  constexpr int dv = NV * Lanes<T>::count;
  constexpr int TQ = tile_rows<NV>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> mapped(elu ? TQ * features : 0);
    for (int64_t r = begin; r < end; ++r) {
      const T* S = kv + r * features * dv;
      const T* z = k_sum + r * features;
      int64_t t0 = 0;
      const T* q[TQ];
      T* o[TQ];
      auto row = [&](int64_t t, int slot) -> const T* {
        if (!elu) return q_in.at(r, t);
        elu_row(mapped.data() + slot * features, q_in.at(r, t), features);
        return mapped.data() + slot * features;
      };
      for (; t0 + TQ <= n; t0 += TQ) {
        for (int i = 0; i < TQ; ++i) {
          q[i] = row(t0 + i, i);
          o[i] = out.at(r, t0 + i);
        }
        read_tile<T, NV, TQ>(q, S, z, o, features, normalize, eps, min_denom, clamp);
      }
      for (; t0 < n; ++t0) {
        q[0] = row(t0, 0);
        o[0] = out.at(r, t0);
        read_tile<T, NV, 1>(q, S, z, o, features, normalize, eps, min_denom, clamp);
      }
    }
  });
}

// Dv in vectors of the build's width, dispatched by its count of 64-byte blocks to a compiled width (the Python
// side admits only these)
#define LINATTN_VECTORS(vectors, ...)                                     \
  switch ((vectors) / kPerBlock) {                                        \
    case 1: { constexpr int NV = 1 * kPerBlock; __VA_ARGS__; break; }   \
    case 2: { constexpr int NV = 2 * kPerBlock; __VA_ARGS__; break; }   \
    case 4: { constexpr int NV = 4 * kPerBlock; __VA_ARGS__; break; }   \
    case 8: { constexpr int NV = 8 * kPerBlock; __VA_ARGS__; break; }   \
    case 16: { constexpr int NV = 16 * kPerBlock; __VA_ARGS__; break; } \
    default: TORCH_CHECK(false, "linattn native: unsupported value width"); \
  }

// qf, kf (R, n, F); v, out (R, n, Dv): last dimension contiguous; kv (R, F, Dv) and k_sum (R, F) contiguous,
// updated in place. min_denom is NaN for none. elu: qf and kf are the raw q and k, mapped here by elu + 1.
void additive_block(const at::Tensor& qf, const at::Tensor& kf, const at::Tensor& v, at::Tensor kv, at::Tensor k_sum,
                    at::Tensor out, bool normalize, double eps, double min_denom, bool elu) {
  const int64_t rows = qf.size(0), n = qf.size(1), features = qf.size(2);
  AT_DISPATCH_FLOATING_TYPES(qf.scalar_type(), "additive_block", [&] {
    const int vectors = static_cast<int>(v.size(2) / Lanes<scalar_t>::count);
    LINATTN_VECTORS(vectors, additive<scalar_t, NV>(view<scalar_t>(qf), view<scalar_t>(kf), view<scalar_t>(v),
                                                    kv.data_ptr<scalar_t>(), k_sum.data_ptr<scalar_t>(),
                                                    view<scalar_t>(out), rows, n, features, normalize, eps,
                                                    min_denom, !std::isnan(min_denom), elu));
  });
}

// qf, kf (R, n, F) features (unit: normalised here; elu: the raw q and k, mapped and normalised here); v, out
// (R, n, Dv); beta (R, n); log_gate (R, n, G) fp64 with G = 1 or F, or None; kv (R, F, Dv) contiguous, updated
// in place.
void delta_block(const at::Tensor& qf, const at::Tensor& kf, const at::Tensor& v, const at::Tensor& beta,
                 const std::optional<at::Tensor>& log_gate, at::Tensor kv, at::Tensor out, bool elu, bool unit) {
  const int64_t rows = qf.size(0), n = qf.size(1), features = qf.size(2);
  const double* gate = log_gate ? log_gate->data_ptr<double>() : nullptr;
  const int64_t gate_row = log_gate ? log_gate->stride(0) : 0, gate_token = log_gate ? log_gate->stride(1) : 0;
  const int64_t gates = log_gate ? log_gate->size(2) : 0;
  AT_DISPATCH_FLOATING_TYPES(qf.scalar_type(), "delta_block", [&] {
    const int vectors = static_cast<int>(v.size(2) / Lanes<scalar_t>::count);
    View<scalar_t> strengths{beta.data_ptr<scalar_t>(), beta.stride(0), beta.stride(1)};
    if (gate != nullptr) {
      LINATTN_VECTORS(vectors, delta<scalar_t, NV, true>(view<scalar_t>(qf), view<scalar_t>(kf), view<scalar_t>(v),
                                                         strengths, gate, gate_row, gate_token, gates,
                                                         kv.data_ptr<scalar_t>(), view<scalar_t>(out), rows, n,
                                                         features, elu, unit || elu));
    } else {
      LINATTN_VECTORS(vectors, delta<scalar_t, NV, false>(view<scalar_t>(qf), view<scalar_t>(kf), view<scalar_t>(v),
                                                          strengths, gate, gate_row, gate_token, gates,
                                                          kv.data_ptr<scalar_t>(), view<scalar_t>(out), rows, n,
                                                          features, elu, unit || elu));
    }
  });
}

// kf (R, n, F) features (elu: the raw keys, mapped here); v (R, n, Dv); kv (R, F, Dv) and k_sum (R, F) contiguous,
// the sums over these keys added in place
void noncausal_accumulate(const at::Tensor& kf, const at::Tensor& v, at::Tensor kv, at::Tensor k_sum, bool elu) {
  const int64_t rows = kf.size(0), n = kf.size(1), features = kf.size(2);
  AT_DISPATCH_FLOATING_TYPES(kf.scalar_type(), "noncausal_accumulate", [&] {
    const int vectors = static_cast<int>(v.size(2) / Lanes<scalar_t>::count);
    LINATTN_VECTORS(vectors, accumulate<scalar_t, NV>(view<scalar_t>(kf), view<scalar_t>(v), kv.data_ptr<scalar_t>(),
                                                      k_sum.data_ptr<scalar_t>(), rows, n, features, elu));
  });
}

// qf (R, n, F) (elu: the raw queries); kv (R, F, Dv), k_sum (R, F) contiguous; out (R, n, Dv) written
void noncausal_read(const at::Tensor& qf, const at::Tensor& kv, const at::Tensor& k_sum, at::Tensor out,
                    bool normalize, double eps, double min_denom, bool elu) {
  const int64_t rows = qf.size(0), n = qf.size(1), features = qf.size(2);
  AT_DISPATCH_FLOATING_TYPES(qf.scalar_type(), "noncausal_read", [&] {
    const int vectors = static_cast<int>(out.size(2) / Lanes<scalar_t>::count);
    LINATTN_VECTORS(vectors, read<scalar_t, NV>(view<scalar_t>(qf), kv.data_ptr<scalar_t>(), k_sum.data_ptr<scalar_t>(),
                                                view<scalar_t>(out), rows, n, features, normalize, eps, min_denom,
                                                !std::isnan(min_denom), elu));
  });
}

// The Hedgehog map's activation after its projection (linattn.feature_maps.HedgehogFeatureMap.features): from
// z = Wx + b (m entries), phi = [softmax(z), softmax(-z)] (2m), times the key's weight e^{clamp(u.k)} (1 for
// queries), plus the floor. softmax(-z)_i = e^{min z - z_i}, the same rounded arguments as torch's softmax of the
// negated row. restrict and the extremes as simd reductions: without them these loops ran 2.2x slower (aliasing
// checks, a scalar max).
template <typename T>
inline void activate_row(const T* __restrict x, T* __restrict up, int64_t half, T scale_row, T lift) {
  T* __restrict down = up + half;
  T top = -std::numeric_limits<T>::infinity(), bottom = std::numeric_limits<T>::infinity();
#pragma omp simd reduction(max : top) reduction(min : bottom)
  for (int64_t i = 0; i < half; ++i) {
    top = x[i] > top ? x[i] : top;
    bottom = x[i] < bottom ? x[i] : bottom;
  }
  T total_up = 0, total_down = 0;
#pragma omp simd reduction(+ : total_up, total_down)
  for (int64_t i = 0; i < half; ++i) {
    const T a = exp_nonpositive<T, false>(x[i] - top), b = exp_nonpositive<T, false>(bottom - x[i]);
    up[i] = a;
    down[i] = b;
    total_up += a;
    total_down += b;
  }
  const T scale_up = scale_row / total_up, scale_down = scale_row / total_down;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    up[i] = up[i] * scale_up + lift;
    down[i] = down[i] * scale_down + lift;
  }
}

template <typename T>
void hedgehog_rows(const T* z, const T* weight, T* out, int64_t rows, int64_t half, double floor) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      activate_row(z + r * half, out + r * 2 * half, half, weight == nullptr ? T(1) : weight[r], static_cast<T>(floor));
  });
}

// The whole map of x (R, n, d): the projection z = Wx + b as a register-blocked product (tiles of 24/NV tokens,
// W^T's d rows of m = 16 NV entries in the first-level cache), then the activation of each tile's rows from the
// stack. Row r uses head r % H: weight_t (H, d, m) = W^T per head, bias (H, m); key_gate (H, d) for keys (their
// weight e^{clamp(u.k)}), none for queries.
template <typename T, int NV>
void hedgehog_map_rows(View<T> x, const T* weight_t, const T* bias, int64_t heads, const T* key_gate, double limit,
                       T* out, int64_t rows, int64_t n, int64_t d, double floor) {
  using V = typename Lanes<T>::vec;
  constexpr int m = NV * Lanes<T>::count;
  constexpr int TQ = tile_rows<NV>();
  constexpr int64_t span = 256;  // tokens a task takes: rows x blocks of tokens share the threads
  const int64_t blocks = (n + span - 1) / span;
  at::parallel_for(0, rows * blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) T z[TQ * m];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / blocks, first = (item % blocks) * span, last = std::min(n, first + span);
      const T* S = weight_t + (r % heads) * d * m;
      const T* b = bias + (r % heads) * m;
      const T* u = key_gate != nullptr ? key_gate + (r % heads) * d : nullptr;
      for (int64_t t0 = first; t0 < last; t0 += TQ) {
        const int tokens = static_cast<int>(std::min<int64_t>(TQ, last - t0));
        V acc[TQ][NV];
#pragma GCC unroll 16
        for (int i = 0; i < TQ; ++i) load_row<T, NV>(acc[i], b);
        const T* rows_in[TQ];
        for (int i = 0; i < TQ; ++i) rows_in[i] = x.at(r, t0 + (i < tokens ? i : 0));
        tile_product<T, NV, TQ>(acc, rows_in, S, d);
        for (int i = 0; i < tokens; ++i) {
          store_row<T, NV>(z + i * m, acc[i], T(1));
          T scale_row = T(1);
          if (u != nullptr) {  // e^{clamp(u.k)}: the key's weight from its row
            const T logit = dot(u, rows_in[i], d);
            scale_row = std::exp(std::min(std::max(logit, static_cast<T>(-limit)), static_cast<T>(limit)));
          }
          activate_row(z + i * m, out + (r * n + t0 + i) * 2 * m, m, scale_row, static_cast<T>(floor));
        }
      }
    }
  });
}

// x (R, n, d) last dimension contiguous; weight_t (H, d, m), bias (H, m) contiguous; key_gate (H, d) contiguous for
// keys, whose weights e^{clamp(u.k, +-limit)} are made here, none for queries. Returns phi (R, n, 2m).
at::Tensor hedgehog_map(const at::Tensor& x, const at::Tensor& weight_t, const at::Tensor& bias,
                        const std::optional<at::Tensor>& key_gate, double limit, double floor) {
  const int64_t rows = x.size(0), n = x.size(1), d = x.size(2), heads = weight_t.size(0), m = weight_t.size(2);
  at::Tensor out = at::empty({rows, n, 2 * m}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "hedgehog_map", [&] {
    const int vectors = static_cast<int>(m / Lanes<scalar_t>::count);
    LINATTN_VECTORS(vectors, hedgehog_map_rows<scalar_t, NV>(
        view<scalar_t>(x), weight_t.data_ptr<scalar_t>(), bias.data_ptr<scalar_t>(), heads,
        key_gate ? key_gate->data_ptr<scalar_t>() : nullptr, limit, out.data_ptr<scalar_t>(), rows, n, d, floor));
  });
  return out;
}

at::Tensor hedgehog_activation(const at::Tensor& z, const std::optional<at::Tensor>& weight, double floor) {
  std::vector<int64_t> shape = z.sizes().vec();
  shape.back() *= 2;
  at::Tensor out = at::empty(shape, z.options());
  const int64_t half = z.size(-1), rows = z.numel() / half;
  AT_DISPATCH_FLOATING_TYPES(z.scalar_type(), "hedgehog_activation", [&] {
    hedgehog_rows<scalar_t>(z.data_ptr<scalar_t>(), weight ? weight->data_ptr<scalar_t>() : nullptr,
                            out.data_ptr<scalar_t>(), rows, half, floor);
  });
  return out;
}


// The sparse exact cache's boundaries beside the delta rule, scored by the memory's recall error ||v - S^T k||
// (linattn/exact/forms/sparse_composed.py, _decide, is the reference; its docstring and sparse_stream.py's define
// the rows X, the entry times and the write stream). Each (batch, head) row runs alone in torch's OpenMP pool: the
// memory carried from boundary to boundary (each step decays it, then writes the pairs leaving the cache there in
// ascending position, then key t - W if it enters at t), the candidates (the cache and the pairs leaving the
// window before the next boundary, neither sinks nor padding) scored in register tiles against the memory as query
// t0 - 1 read it, the `size` best kept (ties: the newer; a NaN score ranks first, as torch's sort puts it), the
// entry times updated. Then the call's write stream is written from the final entry times, piece by piece as
// stream_piece makes it.
constexpr int64_t kNever = int64_t(1) << 62;  // linattn.exact.forms.boundary.NEVER

struct Geometry {
  int64_t X, F, L, n0, end, window, sinks, block, base, ring_start, first, boundaries, gates;
};

// the row of X that holds position p (-1 for none): the window buffer and the call by offset, an older position
// by binary search among the row's carried cache positions (`table`: ascending, kNever in unused slots)
inline int64_t row_of(int64_t p, const Geometry& g, const std::vector<int64_t>& table) {
  if (p < 0) return -1;
  if (p >= g.ring_start) return g.base + p - g.ring_start;
  const auto at = std::lower_bound(table.begin(), table.end(), p);
  return at != table.end() && *at == p ? static_cast<int64_t>(at - table.begin()) : -1;
}

template <typename T, int NV>
void sparse_decide_rows(const T* lin, const T* values, const T* beta, const bool* valid, const int64_t* pos,
                        const int64_t* carried, int64_t* entry, const double* gate, T* kv, const int64_t* sizes,
                        int64_t* chosen_out, std::vector<int64_t>* leaving, int64_t rows,
                        const Geometry g) {
  using V = typename Lanes<T>::vec;
  constexpr int dv = NV * Lanes<T>::count;
  // the scores' register tiles: SR candidates by SW value vectors (3 by 4 on AVX2, 6 by 4 with 32 registers)
  constexpr int SW = NV < 4 ? NV : 4, SR = kRegisters * 3 / 4 / SW > 1 ? kRegisters * 3 / 4 / SW : 1;
  static_assert(NV % SW == 0, "the strips cover the value vectors");
  const int64_t F = g.F, L = g.L;
  // the rows that share out evenly among the threads run a row a thread; the rest (one row on two threads, the
  // third of three) one after another, each boundary's scores shared among the threads (`inner`)
  const int64_t threads = at::get_num_threads(), whole = threads > 1 ? rows - rows % threads : rows;
  auto run_rows = [&](int64_t begin, int64_t end) {
    const bool inner = begin >= whole;
    std::vector<V> state(F * NV), pass(F * NV), squares;
    std::vector<T> a(F), scores, pass_buffers(8 * F), write_k, write_v, write_beta;
    std::vector<double> carry(std::max<int64_t>(g.gates, 1)), write_gates;
    std::vector<int64_t> table(L), members(L), cand_pos, cand_row, order, writes;
    std::vector<char> ok, kept;
    for (int64_t r = begin; r < end; ++r) {
      V* S = state.data();
      T* row_kv = kv + r * F * dv;
      for (int64_t f = 0; f < F; ++f) load_row<T, NV>(S + f * NV, row_kv + f * dv);
      const T* k_rows = lin + r * g.X * F;
      const T* v_rows = values + r * g.X * dv;
      const T* b_row = beta + r * g.X;
      const bool* valid_row = valid + r * g.X;
      int64_t* e = entry + r * g.X;
      const double* gate_row = gate != nullptr ? gate + r * (g.end - g.n0) * g.gates : nullptr;
      for (int64_t i = 0; i < L; ++i) {
        members[i] = carried[r * L + i];
        table[i] = members[i] >= 0 ? members[i] : kNever;
      }
      int64_t cursor = g.n0;
      const std::vector<int64_t>* extras = nullptr;  // the rows leaving the cache at the boundary `cursor`
      for (int64_t b = 0; b < g.boundaries; ++b) {
        const int64_t t0 = g.first + b * g.block;
        // the memory to the end of step t0 - 1. Each step decays it, then writes (S <- S + k u^T with
        // u = beta (v - S^T k); none where beta is 0): the writes are gathered, each with the log-decay of the steps
        // since the write before it (carried to it, a sum of log-gates), and run as the delta rule's pass
        // (delta_item: a write's decay, the write and the next one's recall in one pass over S); decays after the
        // last write scale S once
        writes.clear();
        write_beta.clear();
        write_gates.clear();
        std::fill(carry.begin(), carry.end(), 0.0);
        bool carrying = false;
        auto gather = [&](int64_t j) {
          if (b_row[j] == T(0)) return;
          const int64_t w = static_cast<int64_t>(writes.size());
          writes.push_back(j);
          write_k.resize((w + 1) * F);
          write_v.resize((w + 1) * dv);
          std::memcpy(write_k.data() + w * F, k_rows + j * F, sizeof(T) * F);
          std::memcpy(write_v.data() + w * dv, v_rows + j * dv, sizeof(T) * dv);
          write_beta.push_back(b_row[j]);
          if (gate_row != nullptr) {
            write_gates.insert(write_gates.end(), carry.begin(), carry.begin() + g.gates);
            std::fill(carry.begin(), carry.end(), 0.0);
            carrying = false;
          }
        };
        for (int64_t t = cursor; t < t0; ++t) {
          if (gate_row != nullptr) {
            const double* step = gate_row + (t - g.n0) * g.gates;
            for (int64_t i = 0; i < g.gates; ++i) carry[i] += step[i];
            carrying = true;
          }
          if (extras != nullptr && t == cursor)
            for (const int64_t j : *extras) gather(j);
          const int64_t key = row_of(t - g.window, g, table);
          if (key >= 0 && e[key] == t) gather(key);
        }
        const int64_t written = static_cast<int64_t>(writes.size());
        if (written > 0) {
          const View<T> keys_w{write_k.data(), 0, F}, values_w{write_v.data(), 0, dv};
          const View<T> beta_w{write_beta.data(), 0, 1}, none{nullptr, 0, 0};
          T* memory = reinterpret_cast<T*>(S);  // (F, Dv) as the pass loads and stores it
          if (gate_row != nullptr) {
            delta_item<T, NV, NV, true, false>(keys_w, keys_w, values_w, beta_w, write_gates.data(), g.gates, g.gates,
                                               memory, none, 0, 0, written, F, false, false, pass.data(),
                                               pass_buffers.data());
          } else {
            delta_item<T, NV, NV, false, false>(keys_w, keys_w, values_w, beta_w, nullptr, 0, 0, memory, none, 0, 0,
                                                written, F, false, false, pass.data(), pass_buffers.data());
          }
        }
        if (carrying) {
          factors(a.data(), carry.data(), g.gates, F);
          for (int64_t f = 0; f < F; ++f)
#pragma GCC unroll 16
            for (int q = 0; q < NV; ++q) S[f * NV + q] *= a[f];
        }
        // the candidates: the cache, then the pairs leaving the window before the next boundary
        const int64_t lo = std::max<int64_t>(t0 - g.window, 0), hi = std::max(lo, t0 - g.window + g.block);
        const int64_t count = L + hi - lo;
        cand_pos.resize(count);
        cand_row.resize(count);
        ok.assign(count, 0);
        kept.assign(count, 0);
        scores.assign(count, T(0));
        order.clear();
        for (int64_t i = 0; i < count; ++i) {
          const int64_t p = i < L ? members[i] : lo + (i - L);
          const int64_t j = row_of(p, g, table);
          cand_pos[i] = p;
          cand_row[i] = j;
          ok[i] = j >= 0 && valid_row[j] && p >= g.sinks;
          if (ok[i]) order.push_back(i);
        }
        // scores of the valid candidates: S^T k in register tiles of SR candidates by SW value vectors, a strip of
        // SW vectors of S (F x SW, 16 KB at F = 128 on AVX2) over all of a thread's candidates before the next, so
        // that the strip stays in the first-level cache (one candidate at a time over all of S read the 32 KB of
        // S from the second-level cache for every candidate, which bounded the decisions); each candidate's
        // squared error summed across the strips in one vector, in the value vectors' order, as a whole row's
        // pass sums it. With fewer rows than threads, the tiles of one boundary shared among the threads (a row's
        // boundaries follow one another)
        const int64_t valid_count = static_cast<int64_t>(order.size());
        const int64_t tiles = (valid_count + SR - 1) / SR;
        squares.resize(valid_count);
        auto score_tiles = [&](int64_t tile_begin, int64_t tile_end) {
          const int64_t i_begin = tile_begin * SR, i_end = std::min(valid_count, tile_end * SR);
          for (int64_t i = i_begin; i < i_end; ++i) squares[i] = V{};
          const T* strip_base = reinterpret_cast<const T*>(S);
          for (int j0 = 0; j0 < NV; j0 += SW) {
            for (int64_t i0 = i_begin; i0 < i_end; i0 += SR) {
              const int tile = static_cast<int>(std::min<int64_t>(SR, i_end - i0));
              V acc[SR][SW];
              const T* tile_rows_in[SR];
#pragma GCC unroll 16
              for (int i = 0; i < SR; ++i)
#pragma GCC unroll 16
                for (int q = 0; q < SW; ++q) acc[i][q] = V{};
              for (int i = 0; i < SR; ++i) tile_rows_in[i] = k_rows + cand_row[order[i0 + (i < tile ? i : 0)]] * F;
              for (int64_t f = 0; f < F; ++f) {
                V sv[SW];
                load_row<T, SW>(sv, strip_base + f * dv + j0 * Lanes<T>::count);
#pragma GCC unroll 16
                for (int i = 0; i < SR; ++i) {
                  const T x = tile_rows_in[i][f];
#pragma GCC unroll 16
                  for (int q = 0; q < SW; ++q) acc[i][q] += x * sv[q];
                }
              }
              for (int i = 0; i < tile; ++i) {
                V value[SW];
                load_row<T, SW>(value, v_rows + cand_row[order[i0 + i]] * dv + j0 * Lanes<T>::count);
                V sum = squares[i0 + i];
#pragma GCC unroll 16
                for (int q = 0; q < SW; ++q) {
                  const V d = value[q] - acc[i][q];
                  sum += d * d;
                }
                squares[i0 + i] = sum;
              }
            }
          }
          for (int64_t i = i_begin; i < i_end; ++i) {
            T total = 0;
            for (int lane = 0; lane < Lanes<T>::count; ++lane) total += squares[i][lane];
            scores[order[i]] = std::sqrt(total);
          }
        };
        if (inner) {
          at::parallel_for(0, tiles, 8, score_tiles);
        } else {
          score_tiles(0, tiles);
        }
        // the `size` best: score descending (NaN first), ties the newer. The order is strict (positions differ), so
        // the set of the best is one: partitioned around it (linear time), not sorted
        const int64_t take = std::min<int64_t>(sizes[r], valid_count);
        if (take < valid_count)
          std::nth_element(order.begin(), order.begin() + take, order.end(), [&](int64_t x, int64_t y) {
            const T sx = scores[x], sy = scores[y];
            const bool nx = std::isnan(sx), ny = std::isnan(sy);
            if (nx != ny) return nx;
            if (!nx && sx != sy) return sx > sy;
            return cand_pos[x] > cand_pos[y];
          });
        for (int64_t i = 0; i < take; ++i) kept[order[i]] = 1;
        std::vector<int64_t>& out_rows = leaving[r * g.boundaries + b];
        out_rows.clear();
        for (int64_t i = 0; i < count; ++i) {
          if (!ok[i]) continue;
          if (kept[i]) {
            e[cand_row[i]] = kNever;
          } else if (i < L) {  // dropped from the cache: it enters the memory at t0
            e[cand_row[i]] = t0;
            out_rows.push_back(cand_row[i]);
          }
        }
        std::sort(out_rows.begin(), out_rows.end());
        std::vector<int64_t> now;
        for (int64_t i = 0; i < count; ++i)
          if (kept[i]) now.push_back(cand_pos[i]);
        std::sort(now.begin(), now.end());
        int64_t* chosen = chosen_out + (r * g.boundaries + b) * L;
        for (int64_t i = 0; i < L; ++i) {
          members[i] = i < static_cast<int64_t>(now.size()) ? now[i] : -1;
          chosen[i] = members[i];
        }
        cursor = t0;
        extras = &out_rows;
      }
    }
  };
  if (whole > 0) at::parallel_for(0, whole, 1, run_rows);
  if (whole < rows) run_rows(whole, rows);
}

// lin (R, X, F) the rows' unit key features (0 where not valid), values (R, X, Dv), beta (R, X) (0 where not
// valid), valid (R, X) bool, pos (R, X), carried (R, L) the carried cache's positions (ascending, -1 unused), entry
// (R, X) the entry times before the call's decisions (updated in place), log_gate (R, N, G) fp64 per call token or
// none, kv (R, F, Dv) the memory at the call's start (updated in place: at the last boundary), sizes (R,); all
// contiguous. Returns the caches chosen at the call's boundaries (R, boundaries, L) and the write stream: the rows
// written (R, M) (-1 none), and per slot the call token whose decay applies (M,), the token read, the step's token.
std::vector<at::Tensor> sparse_delta_decide(const at::Tensor& lin, const at::Tensor& values, const at::Tensor& beta,
                                            const at::Tensor& valid, const at::Tensor& pos, const at::Tensor& carried,
                                            at::Tensor entry, const std::optional<at::Tensor>& log_gate, at::Tensor kv,
                                            const at::Tensor& sizes, int64_t n0, int64_t end, int64_t window,
                                            int64_t sinks, int64_t block, int64_t base, int64_t ring_start) {
  const int64_t rows = lin.size(0);
  const int64_t first = std::max(((n0 + block - 1) / block) * block, block);
  const int64_t boundaries = first < end ? (end - first + block - 1) / block : 0;
  const Geometry g{lin.size(1), lin.size(2), carried.size(1), n0, end, window, sinks, block, base, ring_start,
                   first, boundaries, log_gate ? log_gate->size(2) : 0};
  at::Tensor chosen = at::full({rows, boundaries, g.L}, -1, pos.options());
  std::vector<std::vector<int64_t>> leaving(rows * boundaries);
  AT_DISPATCH_FLOATING_TYPES(lin.scalar_type(), "sparse_delta_decide", [&] {
    const int vectors = static_cast<int>(values.size(2) / Lanes<scalar_t>::count);
    LINATTN_VECTORS(vectors, sparse_decide_rows<scalar_t, NV>(
        lin.data_ptr<scalar_t>(), values.data_ptr<scalar_t>(), beta.data_ptr<scalar_t>(), valid.data_ptr<bool>(),
        pos.data_ptr<int64_t>(), carried.data_ptr<int64_t>(), entry.data_ptr<int64_t>(),
        log_gate ? log_gate->data_ptr<double>() : nullptr, kv.data_ptr<scalar_t>(), sizes.data_ptr<int64_t>(),
        chosen.data_ptr<int64_t>(), leaving.data(), rows, g));
  });
  // the stream: piece 0 the steps n0 ... first - 1, piece b + 1 from boundary b (its leaving rows first)
  std::vector<int64_t> width(boundaries, 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < boundaries; ++b)
      width[b] = std::max<int64_t>(width[b], static_cast<int64_t>(leaving[r * boundaries + b].size()));
  int64_t slots = end - n0;
  for (const int64_t w : width) slots += w;
  at::Tensor stream_rows = at::full({rows, slots}, -1, pos.options());
  at::Tensor gate_at = at::empty({slots}, pos.options()), read = at::empty({slots}, pos.options());
  at::Tensor step = at::empty({slots}, pos.options());
  int64_t* gate_data = gate_at.data_ptr<int64_t>();
  int64_t* read_data = read.data_ptr<int64_t>();
  int64_t* step_data = step.data_ptr<int64_t>();
  std::vector<int64_t> piece_start(boundaries + 1);  // each piece's first slot
  {
    int64_t slot = 0;
    for (int64_t piece = 0; piece <= boundaries; ++piece) {
      piece_start[piece] = slot;
      const int64_t lo = piece == 0 ? n0 : first + (piece - 1) * block;
      const int64_t hi = piece < boundaries ? first + piece * block : end;
      const int64_t extra = piece == 0 ? 0 : width[piece - 1];
      for (int64_t i = 0; i < extra; ++i, ++slot) {
        gate_data[slot] = i == 0 ? lo - n0 : -1;
        read_data[slot] = -1;
        step_data[slot] = lo - n0;
      }
      for (int64_t t = lo; t < hi; ++t, ++slot) {
        gate_data[slot] = extra > 0 && t == lo ? -1 : t - n0;
        read_data[slot] = t - n0;
        step_data[slot] = t - n0;
      }
    }
  }
  int64_t* out = stream_rows.data_ptr<int64_t>();
  const int64_t* entries = entry.data_ptr<int64_t>();
  const int64_t* carried_data = carried.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t stop) {
    std::vector<int64_t> table(g.L);
    for (int64_t r = begin; r < stop; ++r) {
      for (int64_t i = 0; i < g.L; ++i) table[i] = carried_data[r * g.L + i] >= 0 ? carried_data[r * g.L + i] : kNever;
      const int64_t* e = entries + r * g.X;
      int64_t* row_out = out + r * slots;
      for (int64_t piece = 0; piece <= boundaries; ++piece) {
        const int64_t lo = piece == 0 ? n0 : first + (piece - 1) * block;
        const int64_t hi = piece < boundaries ? first + piece * block : end;
        int64_t slot = piece_start[piece];
        if (piece > 0) {
          const std::vector<int64_t>& extra = leaving[r * boundaries + piece - 1];
          for (size_t i = 0; i < extra.size(); ++i) row_out[slot + i] = extra[i];
          slot += width[piece - 1];
        }
        for (int64_t t = lo; t < hi; ++t, ++slot) {
          const int64_t key = row_of(t - window, g, table);
          if (key >= 0 && e[key] == t) row_out[slot] = key;
        }
      }
    }
  });
  return {chosen, stream_rows, gate_at, read, step};
}


// w[u] <- e^{scale w[u] - top} for u < seen, 0 for the rest of the row's width, where top is the larger of `best`
// and the seen scores (0 where both are -inf); returns the sum of the weights and sets top. Out of line from its
// caller, whose matrix products can throw: GCC vectorises no loop in a region that can throw (these ran scalar).
template <typename T>
T exact_weights(T* __restrict w, int64_t seen, int64_t width, T scale, T best, T& top) {
#pragma omp simd reduction(max : best)
  for (int64_t u = 0; u < seen; ++u) best = w[u] * scale > best ? w[u] * scale : best;
  const T shift = best == -std::numeric_limits<T>::infinity() ? T(0) : best;
  T total = 0;
#pragma omp simd reduction(+ : total)
  for (int64_t u = 0; u < seen; ++u) {
    w[u] = exp_nonpositive<T, false>(w[u] * scale - shift);
    total += w[u];
  }
  for (int64_t u = seen; u < width; ++u) w[u] = T(0);
  top = shift;
  return total;
}

// The sparse cache's exact term in inference (exact/forms/cache_term.py's CacheTerm.forward without the linear
// additions is the reference): query block g of a padded call (queries g B ... g B + B - 1) scores the pairs its
// cache names, exactly where a pair has left the window (p + W <= t), against one shift per query, the larger of
// the window's own row max and the block's; returns sum e^{s - top} v, sum e^{s - top} and top. Each (row, block)
// gathers its cache's keys and values once, then takes the scores Q K^T and the weighted values P V as two matrix
// products of torch's BLAS, single-threaded inside the rows' OpenMP pool, into buffers of its own (the products
// are B x D x L with L up to a few thousand pairs: register tiles of one query, all that AVX2's registers held at
// Dv = 64, streamed the cache from the second-level cache for every query: 2-3x slower on a call of the
// shipped student's at 8k, with the exponential's fix in both).
template <typename T>
void cache_exact_blocks(const T* q, const T* keys, const T* values, const T* ls, const int64_t* rows_at,
                        const int64_t* positions, T* ex_num, T* ex_den, T* top, int64_t rows, int64_t padded,
                        int64_t xs, int64_t d, int64_t dv, int64_t blocks, int64_t slots, int64_t first,
                        int64_t block, int64_t window, T scale, const at::TensorOptions& options) {
  at::parallel_for(0, rows * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> gathered_keys, gathered_values, weights;
    std::vector<int64_t> used_row, used_pos;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / blocks, g = item % blocks;
      const int64_t* index = rows_at + item * slots;
      const int64_t* where = positions + item * slots;
      used_row.clear();
      used_pos.clear();
      for (int64_t j = 0; j < slots; ++j)
        if (index[j] >= 0 && where[j] >= 0) {
          used_row.push_back(index[j]);
          used_pos.push_back(where[j]);
        }
      const int64_t used = static_cast<int64_t>(used_row.size());
      if (!std::is_sorted(used_pos.begin(), used_pos.end())) {  // (a cache's positions ascend: never, in the op)
        std::vector<int64_t> by(used);
        for (int64_t u = 0; u < used; ++u) by[u] = u;
        std::sort(by.begin(), by.end(), [&](int64_t x, int64_t y) { return used_pos[x] < used_pos[y]; });
        std::vector<int64_t> row_sorted(used), pos_sorted(used);
        for (int64_t u = 0; u < used; ++u) {
          row_sorted[u] = used_row[by[u]];
          pos_sorted[u] = used_pos[by[u]];
        }
        used_row.swap(row_sorted);
        used_pos.swap(pos_sorted);
      }
      const int64_t width = std::max<int64_t>(used, 1);
      // every row the products read is copied below; a cache with no pair reads one zero row
      gathered_keys.resize(width * d);
      gathered_values.resize(width * dv);
      if (used == 0) {
        std::fill(gathered_keys.begin(), gathered_keys.end(), T(0));
        std::fill(gathered_values.begin(), gathered_values.end(), T(0));
      }
      weights.resize(block * width);
      for (int64_t u = 0; u < used; ++u) {
        std::memcpy(gathered_keys.data() + u * d, keys + (r * xs + used_row[u]) * d, sizeof(T) * d);
        std::memcpy(gathered_values.data() + u * dv, values + (r * xs + used_row[u]) * dv, sizeof(T) * dv);
      }
      const int64_t row0 = r * padded + g * block;
      at::Tensor scores = at::from_blob(weights.data(), {block, width}, options);
      at::mm_out(scores, at::from_blob(const_cast<T*>(q) + row0 * d, {block, d}, options),
                 at::from_blob(gathered_keys.data(), {width, d}, options).t());
      for (int64_t i = 0; i < block; ++i) {
        const int64_t t = first + g * block + i;
        T* w = weights.data() + i * width;
        // the cache's positions ascend, so the pairs that have left query t's window are a prefix
        const int64_t seen = std::upper_bound(used_pos.begin(), used_pos.end(), t - window) - used_pos.begin();
        ex_den[row0 + i] = exact_weights(w, seen, width, scale, ls[row0 + i], top[row0 + i]);
      }
      at::Tensor num = at::from_blob(ex_num + row0 * dv, {block, dv}, options);
      at::mm_out(num, scores, at::from_blob(gathered_values.data(), {width, dv}, options));
    }
  });
}

// q (R, P, D) the queries padded to P = blocks x B; keys (R, X, D), values (R, X, Dv) the rows X; ls (R, P) the
// window's row max (-inf: none); rows, positions (R, blocks, L) each block's cache (-1: none); first: the position
// of padded query 0. Returns (ex_num (R, P, Dv), ex_den (R, P), top (R, P)). All contiguous; D and Dv any (the
// Python side passes the compiled widths only).
std::vector<at::Tensor> cache_exact(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                    const at::Tensor& ls, const at::Tensor& rows_at, const at::Tensor& positions,
                                    int64_t first, int64_t block, int64_t window, double scale) {
  const int64_t rows = q.size(0), padded = q.size(1), d = q.size(2), dv = values.size(2);
  at::Tensor ex_num = at::empty({rows, padded, dv}, q.options());
  at::Tensor ex_den = at::empty({rows, padded}, q.options()), top = at::empty({rows, padded}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "cache_exact", [&] {
    cache_exact_blocks<scalar_t>(
        q.data_ptr<scalar_t>(), keys.data_ptr<scalar_t>(), values.data_ptr<scalar_t>(), ls.data_ptr<scalar_t>(),
        rows_at.data_ptr<int64_t>(), positions.data_ptr<int64_t>(), ex_num.data_ptr<scalar_t>(),
        ex_den.data_ptr<scalar_t>(), top.data_ptr<scalar_t>(), rows, padded, keys.size(1), d, dv, rows_at.size(1),
        rows_at.size(2), first, block, window, static_cast<scalar_t>(scale), q.options());
  });
  return {ex_num, ex_den, top};
}

// The window's band in inference: the softmax average over each query's band of keys and its sinks
// (exact/forms/flash_band.py's band_average is the reference, and its layout): query i of a row sees the key rows y
// of [prefix; keys] with max(i, front) <= y <= min(i + width, P + N - 1), and the sink keys its mask admits. Queries
// go in blocks of kBandQueries; each block copies its key rows transposed (D x (block + width), 53 KB at D = 64,
// B = 64: the second-level cache, each query's part of it in the first), so that a query's B + 1 scores are a row
// of vectors, q_i[x] broadcast against row x of the copy (no horizontal sums); the weights are exact_weights', and
// the weighted values are summed in registers. Torch's flash kernel scored each block of 32 queries against 32 + B
// keys through its own tiles. Blocks of 128 queries, not 32, copy each key 1.6 times, not 3.3: the band 0.82-0.91x
// the time at 1.5k and 8k tokens (2 AVX2 threads; the copy's scattered stores were a third of the kernel's own
// time at 32).
constexpr int64_t kBandQueries = 128;

// s[c lanes ...] = sum_x q[x] kt[x][c lanes ...] for CV vectors of scores
template <typename T, int CV>
inline void band_scores(T* s, const T* q, const T* kt, int64_t stride, int64_t d) {
  using V = typename Lanes<T>::vec;
  constexpr int lanes = Lanes<T>::count;
  V acc[CV];
#pragma GCC unroll 16
  for (int c = 0; c < CV; ++c) acc[c] = V{};
  for (int64_t x = 0; x < d; ++x) {
    const V b = V{} + q[x];
    const T* row = kt + x * stride;
#pragma GCC unroll 16
    for (int c = 0; c < CV; ++c) {
      V k;
      std::memcpy(&k, row + c * lanes, sizeof(k));
      acc[c] += b * k;
    }
  }
#pragma GCC unroll 16
  for (int c = 0; c < CV; ++c) std::memcpy(s + c * lanes, &acc[c], sizeof(acc[c]));
}

// band_scores over `count` scores: in one pass of up to 12 vectors (one chain of sums per vector: fewer than 8
// would wait on the multiply-adds' latency), more in passes of 8 first
template <typename T>
void band_scores_any(T* s, const T* q, const T* kt, int64_t stride, int64_t d, int64_t count) {
  constexpr int lanes = Lanes<T>::count;
  int64_t c = 0, vectors = (count + lanes - 1) / lanes;  // the last one may run past `count`: spare lanes
  for (; vectors > 12; c += 8 * lanes, vectors -= 8) band_scores<T, 8>(s + c, q, kt + c, stride, d);
  switch (vectors) {
    case 0: break;
    case 1: band_scores<T, 1>(s + c, q, kt + c, stride, d); break;
    case 2: band_scores<T, 2>(s + c, q, kt + c, stride, d); break;
    case 3: band_scores<T, 3>(s + c, q, kt + c, stride, d); break;
    case 4: band_scores<T, 4>(s + c, q, kt + c, stride, d); break;
    case 5: band_scores<T, 5>(s + c, q, kt + c, stride, d); break;
    case 6: band_scores<T, 6>(s + c, q, kt + c, stride, d); break;
    case 7: band_scores<T, 7>(s + c, q, kt + c, stride, d); break;
    case 8: band_scores<T, 8>(s + c, q, kt + c, stride, d); break;
    case 9: band_scores<T, 9>(s + c, q, kt + c, stride, d); break;
    case 10: band_scores<T, 10>(s + c, q, kt + c, stride, d); break;
    case 11: band_scores<T, 11>(s + c, q, kt + c, stride, d); break;
    default: band_scores<T, 12>(s + c, q, kt + c, stride, d); break;
  }
}

// acc += weight * row over NV vectors
template <typename T, int NV>
inline void add_scaled_row(typename Lanes<T>::vec* acc, const T* row, T weight) {
  using V = typename Lanes<T>::vec;
  const V w = V{} + weight;
#pragma GCC unroll 16
  for (int j = 0; j < NV; ++j) {
    V x;
    std::memcpy(&x, row + j * Lanes<T>::count, sizeof(x));
    acc[j] += w * x;
  }
}

template <typename T, int NV>
void band_rows(View<T> q, View<T> k_pre, View<T> k_main, View<T> v_pre, View<T> v_main, const T* sink_k,
               const T* sink_v, const bool* sink_mask, T* out, T* lse, int64_t rows, int64_t n, int64_t prefix,
               int64_t sinks, int64_t d, int64_t width, int64_t front, T scale) {
  using V = typename Lanes<T>::vec;
  constexpr int lanes = Lanes<T>::count;
  constexpr int64_t dv = NV * lanes;
  const int64_t blocks = (n + kBandQueries - 1) / kBandQueries, end = prefix + n;
  const int64_t band = width + 1, padded = (band + lanes - 1) / lanes * lanes;
  // the copy's row: every key a block's queries read, and the lanes a query's last vector of scores reads past them
  const int64_t stride = kBandQueries + padded + lanes;
  at::parallel_for(0, rows * blocks, 1, [&](int64_t begin, int64_t stop) {
    const int64_t row_w = padded + lanes;  // a query's scores, then weights (its last vector may run past the band)
    std::vector<T> kt(d * stride), w(kBandQueries * row_w), sink_w(kBandQueries * std::max<int64_t>(sinks, 1));
    std::vector<T> inverse(kBandQueries);
    std::vector<const T*> value_rows(stride);
    for (int64_t item = begin; item < stop; ++item) {
      const int64_t r = item / blocks, i0 = (item % blocks) * kBandQueries;
      const int64_t i1 = std::min(n, i0 + kBandQueries);
      for (int64_t c = 0; c < stride; ++c) {  // key row i0 + c, transposed; rows past the end read as 0
        const int64_t y = i0 + c;
        const T* key = y < prefix ? k_pre.at(r, y) : y < end ? k_main.at(r, y - prefix) : nullptr;
        value_rows[c] = y < prefix ? v_pre.at(r, y) : y < end ? v_main.at(r, y - prefix) : nullptr;
        for (int64_t x = 0; x < d; ++x) kt[x * stride + c] = key != nullptr ? key[x] : T(0);
      }
      // the block's weights first (the key copy in the first-level cache), then its weighted values
      for (int64_t i = i0; i < i1; ++i) {
        const T* qi = q.at(r, i);
        T* wi = w.data() + (i - i0) * row_w;
        T* si = sink_w.data() + (i - i0) * sinks;
        const int64_t lo = std::max<int64_t>(0, front - i), hi = std::min(band, end - i);  // its keys: i + lo ...
        T best = -std::numeric_limits<T>::infinity();
        for (int64_t u = 0; u < sinks; ++u) {
          const bool sees = sink_mask[(r * n + i) * sinks + u];
          si[u] = sees ? dot(qi, sink_k + (r * sinks + u) * d, d) * scale : -std::numeric_limits<T>::infinity();
          best = si[u] > best ? si[u] : best;
        }
        T top = best, total = 0;
        const int64_t seen = std::max<int64_t>(0, hi - lo);
        if (seen > 0) {
          band_scores_any(wi + lo, qi, kt.data() + (i - i0) + lo, stride, d, seen);
          total = exact_weights(wi + lo, seen, seen, scale, best, top);
        }
        for (int64_t u = 0; u < sinks; ++u) {
          si[u] = si[u] == -std::numeric_limits<T>::infinity() ? T(0) : exp_nonpositive<T, false>(si[u] - top);
          total += si[u];
        }
        // no key at all: 0 and lse -inf (the caller's layout gives every query its own key)
        inverse[i - i0] = total > T(0) ? T(1) / total : T(0);
        lse[r * n + i] = total > T(0) ? top + std::log(total) : -std::numeric_limits<T>::infinity();
      }
      for (int64_t i = i0; i < i1; ++i) {
        const T* wi = w.data() + (i - i0) * row_w;
        const T* si = sink_w.data() + (i - i0) * sinks;
        const int64_t lo = std::max<int64_t>(0, front - i), hi = std::min(band, end - i);
        V acc[NV];
#pragma GCC unroll 16
        for (int j = 0; j < NV; ++j) acc[j] = V{};
        for (int64_t u = lo; u < hi; ++u) add_scaled_row<T, NV>(acc, value_rows[i - i0 + u], wi[u]);
        for (int64_t u = 0; u < sinks; ++u)
          if (si[u] != T(0)) add_scaled_row<T, NV>(acc, sink_v + (r * sinks + u) * dv, si[u]);
        store_row<T, NV>(out + (r * n + i) * dv, acc, inverse[i - i0]);
      }
    }
  });
}

// q (R, N, D); k_pre (R, P, D), keys (R, N, D); v_pre (R, P, Dv), values (R, N, Dv): their last dimension
// contiguous; sink_k (R, S, D), sink_v (R, S, Dv), sink_mask (R, N, S) bool (S may be 0): contiguous. Returns
// (A (R, N, Dv), lse (R, N)).
std::vector<at::Tensor> band_average(const at::Tensor& q, const at::Tensor& k_pre, const at::Tensor& keys,
                                     const at::Tensor& v_pre, const at::Tensor& values, const at::Tensor& sink_k,
                                     const at::Tensor& sink_v, const at::Tensor& sink_mask, int64_t width,
                                     int64_t front, double scale) {
  const int64_t rows = q.size(0), n = q.size(1), d = q.size(2), dv = values.size(2);
  at::Tensor out = at::empty({rows, n, dv}, q.options()), lse = at::empty({rows, n}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "band_average", [&] {
    const int vectors = static_cast<int>(dv / Lanes<scalar_t>::count);
    LINATTN_VECTORS(vectors, band_rows<scalar_t, NV>(
        view<scalar_t>(q), view<scalar_t>(k_pre), view<scalar_t>(keys), view<scalar_t>(v_pre),
        view<scalar_t>(values), sink_k.data_ptr<scalar_t>(), sink_v.data_ptr<scalar_t>(),
        sink_mask.data_ptr<bool>(), out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(), rows, n, k_pre.size(1),
        sink_k.size(1), d, width, front, static_cast<scalar_t>(scale)));
  });
  return {out, lse};
}

// The chunked delta rule's two sequential sweeps, for the torch autograd form (kinds/delta/forms.py: _state_sweep
// and adjoint_sweep are the reference; kinds/kda/forms.py shares them). Everything chunk-local is computed there in
// batched products; what is left is a loop over the chunks of each (batch, head) row in which every step is three
// 64-sized products on the running F x Dv state. Here one thread carries one row through all its chunks with the
// state in the first-level cache (rows in parallel), the products register-blocked as above, and nothing is copied
// but the states the backward pass keeps. Every tensor is contiguous; `last` is each chunk's decay of the state,
// (R, nc, L) with L = 1 (one per chunk) or F (one per feature), or absent.
//
//   forward:  states[c] = S;  U_c = W_v,c - W_k,c S  (over W_v, in place);  S <- last_c * S + K_out,c^T U_c
//   backward: leaving[c] = dS;  dU_c = P_do,c + K_out,c dS  (over P_do, in place);
//             dS <- last_c * dS + (bQ)_c^T dO_c - W_k,c^T dU_c
template <typename T>
inline void scale_state(T* S, const T* factor, int64_t gates, int64_t features, int64_t width) {
  if (factor == nullptr) return;
  for (int64_t f = 0; f < features; ++f) {
    const T a = factor[gates == 1 ? 0 : f];
    for (int64_t j = 0; j < width; ++j) S[f * width + j] *= a;
  }
}

// out[t] = base[t] + sign * sum_f a[t][f] S[f] for R rows from t0 (a: rows of F, S: F x Dv, base and out rows of
// Dv; out may be base)
template <typename T, int NV, int R, bool NEG>
inline void rows_tile(T* out, const T* base, const T* a, const T* S, int64_t t0, int64_t features) {
  using V = typename Lanes<T>::vec;
  constexpr int dv = NV * Lanes<T>::count;
  V acc[R][NV];
  const T* rows[R];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
    rows[i] = a + (t0 + i) * features;
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) acc[i][j] = V{};
  }
  tile_product<T, NV, R>(acc, rows, S, features);
  for (int i = 0; i < R; ++i) {
    V x[NV];
    load_row<T, NV>(x, base + (t0 + i) * dv);
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) x[j] = NEG ? x[j] - acc[i][j] : x[j] + acc[i][j];
    store_row<T, NV>(out + (t0 + i) * dv, x, T(1));
  }
}

// rows_tile over the C rows of one chunk
template <typename T, int NV, bool NEG>
inline void chunk_rows(T* out, const T* base, const T* a, const T* S, int64_t chunk, int64_t features) {
  constexpr int TQ = tile_rows<NV>();
  int64_t t0 = 0;
  for (; t0 + TQ <= chunk; t0 += TQ) rows_tile<T, NV, TQ, NEG>(out, base, a, S, t0, features);
  for (; t0 < chunk; ++t0) rows_tile<T, NV, 1, NEG>(out, base, a, S, t0, features);
}

// S[f] += sign * sum_t k[t][f] x[t] over the C tokens of one chunk (k: C x F, x: C x Dv), strip by strip of S
template <typename T, int NV, bool NEG>
inline void chunk_rank(T* S, const T* k, const T* x, int64_t chunk, int64_t features) {
  constexpr int dv = NV * Lanes<T>::count;
  constexpr int FR = tile_rows<NV>();
  int64_t f0 = 0;
  for (; f0 + FR <= features; f0 += FR) rank_strip<T, NV, FR, NEG>(S + f0 * dv, k + f0, features, x, dv, chunk);
  if (f0 < features)
    rank_rest<T, NV, FR, NEG>(static_cast<int>(features - f0), S + f0 * dv, k + f0, features, x, dv, chunk);
}

template <typename T, int NV>
void state_sweep_rows(T* state, const T* w_k, T* written, const T* k_out, const T* last, int64_t gates, T* states,
                      int64_t rows, int64_t chunks, int64_t chunk, int64_t features) {
  constexpr int dv = NV * Lanes<T>::count;
  const int64_t square = features * dv, keys = chunk * features, values = chunk * dv;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* S = state + r * square;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t at = r * chunks + c;
        std::memcpy(states + at * square, S, sizeof(T) * square);
        T* u = written + at * values;
        chunk_rows<T, NV, true>(u, u, w_k + at * keys, S, chunk, features);
        scale_state(S, last != nullptr ? last + at * gates : nullptr, gates, features, dv);
        chunk_rank<T, NV, false>(S, k_out + at * keys, u, chunk, features);
      }
    }
  });
}

template <typename T, int NV>
void adjoint_sweep_rows(const T* bq, const T* k_out, const T* w_k, T* d_written, const T* d_o, const T* last,
                        int64_t gates, T* d_state, T* d_leaving, int64_t rows, int64_t chunks, int64_t chunk,
                        int64_t features) {
  constexpr int dv = NV * Lanes<T>::count;
  const int64_t square = features * dv, keys = chunk * features, values = chunk * dv;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* dS = d_state + r * square;
      for (int64_t c = chunks - 1; c >= 0; --c) {
        const int64_t at = r * chunks + c;
        std::memcpy(d_leaving + at * square, dS, sizeof(T) * square);
        T* d_u = d_written + at * values;
        chunk_rows<T, NV, false>(d_u, d_u, k_out + at * keys, dS, chunk, features);
        scale_state(dS, last != nullptr ? last + at * gates : nullptr, gates, features, dv);
        chunk_rank<T, NV, false>(dS, bq + at * keys, d_o + at * values, chunk, features);
        chunk_rank<T, NV, true>(dS, w_k + at * keys, d_u, chunk, features);
      }
    }
  });
}

// state (R, F, Dv) updated in place to the final state; w_k, k_out (R, nc, C, F); written (R, nc, C, Dv): W_v on
// entry, U on return; last (R, nc, L) or None; states (R, nc, F, Dv) receives the state entering each chunk
void delta_state_sweep(at::Tensor state, const at::Tensor& w_k, at::Tensor written, const at::Tensor& k_out,
                       const c10::optional<at::Tensor>& last, at::Tensor states) {
  const int64_t rows = w_k.size(0), chunks = w_k.size(1), chunk = w_k.size(2), features = w_k.size(3);
  const int64_t gates = last.has_value() ? last->size(2) : 0;
  AT_DISPATCH_FLOATING_TYPES(w_k.scalar_type(), "delta_state_sweep", [&] {
    const int vectors = static_cast<int>(written.size(3) / Lanes<scalar_t>::count);
    LINATTN_VECTORS(vectors, state_sweep_rows<scalar_t, NV>(
        state.data_ptr<scalar_t>(), w_k.data_ptr<scalar_t>(), written.data_ptr<scalar_t>(),
        k_out.data_ptr<scalar_t>(), last.has_value() ? last->data_ptr<scalar_t>() : nullptr, gates,
        states.data_ptr<scalar_t>(), rows, chunks, chunk, features));
  });
}

// bq, k_out, w_k (R, nc, C, F); d_written (R, nc, C, Dv): P^T dO on entry, dU on return; d_o (R, nc, C, Dv); last
// (R, nc, L) or None; d_state (R, F, Dv): the final state's adjoint on entry, the initial state's on return;
// d_leaving (R, nc, F, Dv) receives the adjoint of the state leaving each chunk
void delta_adjoint_sweep(const at::Tensor& bq, const at::Tensor& k_out, const at::Tensor& w_k, at::Tensor d_written,
                         const at::Tensor& d_o, const c10::optional<at::Tensor>& last, at::Tensor d_state,
                         at::Tensor d_leaving) {
  const int64_t rows = w_k.size(0), chunks = w_k.size(1), chunk = w_k.size(2), features = w_k.size(3);
  const int64_t gates = last.has_value() ? last->size(2) : 0;
  AT_DISPATCH_FLOATING_TYPES(w_k.scalar_type(), "delta_adjoint_sweep", [&] {
    const int vectors = static_cast<int>(d_written.size(3) / Lanes<scalar_t>::count);
    LINATTN_VECTORS(vectors, adjoint_sweep_rows<scalar_t, NV>(
        bq.data_ptr<scalar_t>(), k_out.data_ptr<scalar_t>(), w_k.data_ptr<scalar_t>(), d_written.data_ptr<scalar_t>(),
        d_o.data_ptr<scalar_t>(), last.has_value() ? last->data_ptr<scalar_t>() : nullptr, gates,
        d_state.data_ptr<scalar_t>(), d_leaving.data_ptr<scalar_t>(), rows, chunks, chunk, features));
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("additive_block", &additive_block, "causal linear attention over a block of tokens, continuing (kv, k_sum)");
  m.def("elu_features", [](const at::Tensor& x) {  // (R, n, D) contiguous rows: the map alone, for the tests
    at::Tensor out = at::empty_like(x);
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "elu_features", [&] {
      const int64_t rows = x.numel() / x.size(-1), width = x.size(-1);
      for (int64_t i = 0; i < rows; ++i) elu_row(out.data_ptr<scalar_t>() + i * width, x.data_ptr<scalar_t>() + i * width, width);
    });
    return out;
  }, "elu + 1 of contiguous rows, as the additive kernel makes it");
  m.def("hedgehog_activation", &hedgehog_activation, "the Hedgehog map from z = Wx + b (keys: with their weight)");
  m.def("hedgehog_map", &hedgehog_map, "the Hedgehog map of x: projection and activation (keys: with their weight)");
  m.def("delta_block", &delta_block, "the (gated, per-feature gated) delta rule over a block of tokens");
  m.def("band_average", &band_average, "the window's band softmax average and log-sum-exp, with sinks, in inference");
  m.def("cache_exact", &cache_exact, "the sparse cache's exact term of a call's query blocks, in inference");
  m.def("sparse_delta_decide", &sparse_delta_decide,
        "the sparse cache's boundaries beside the delta rule (recall score) and the call's write stream");
  m.def("delta_state_sweep", &delta_state_sweep, "the chunked delta rule's forward sweep over the chunks (training)");
  m.def("delta_adjoint_sweep", &delta_adjoint_sweep,
        "the chunked delta rule's adjoint sweep over the chunks, backwards (training)");
  m.def("noncausal_accumulate", &noncausal_accumulate, "non-causal: S += sum phi(k) v^T, z += sum phi(k) over a block");
  m.def("noncausal_read", &noncausal_read, "non-causal: out = S^T phi(q) / phi(q).z over a block of queries");
}

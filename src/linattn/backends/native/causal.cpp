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
// The value rows are held in vectors of 64 bytes (GCC's vector extension: zmm registers where the build targets
// AVX-512, pairs or quads of narrower registers elsewhere), so Dv must be a multiple of 16 (fp32) or 8 (fp64) and
// at most 16 such vectors: the Python side checks it and leaves other sizes to the torch forms. Rows (batch x
// heads) run in parallel in torch's OpenMP pool. Nothing here checks its inputs: the Python caller does, once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/python.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

template <typename T>
struct Lanes {
  typedef T vec __attribute__((vector_size(64)));
  static constexpr int count = 64 / sizeof(T);
};

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
  const T n = (clipped * T(1.4426950408889634) + shifter) - shifter;
  const T r = (clipped - n * T(0.693145751953125)) - n * T(1.4286068203094173e-06);
  // Horner's rule on the coefficients 1/i! (one fused multiply-add a degree; the nested form 1 + r/i (1 + ...)
  // took two operations a degree)
  T p = static_cast<T>(inverse_factorials[C::degree]);
#pragma GCC unroll 16
  for (int i = C::degree - 1; i >= 0; --i) p = p * r + static_cast<T>(inverse_factorials[i]);
  const Bits bits = (static_cast<Bits>(n) + C::bias) << C::mantissa;
  const T e = p * __builtin_bit_cast(T, bits);  // 2^n (GCC and Clang; a memcpy here would stop vectorisation)
  if (!floored) return x <= C::low ? T(0) : e;  // below the smallest normal number: 0, as softmax's exp gives
  return x <= C::low || e < C::tiny ? C::tiny : e;
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
    for (int64_t f = 0; f < features; ++f) out[f] = static_cast<T>(std::exp(gate[f]));
  }
}

// one query or key row as the delta rule reads it: the map (elu + 1 here, or features given) and, with `unit`,
// divided by max(|row|, 1e-12) (linattn.features.unit_rows)
template <typename T>
const T* prepare(T* into, const T* row, int64_t features, bool elu, bool unit) {
  if (!elu && !unit) return row;
  if (elu) {
    elu_row(into, row, features);
  } else {
    for (int64_t f = 0; f < features; ++f) into[f] = row[f];
  }
  if (unit) {
    T norm = 0;
#pragma omp simd reduction(+ : norm)
    for (int64_t f = 0; f < features; ++f) norm += into[f] * into[f];
    norm = std::sqrt(norm);
    const T inverse = T(1) / (norm > T(1e-12) ? norm : T(1e-12));
    for (int64_t f = 0; f < features; ++f) into[f] *= inverse;
  }
  return into;
}

template <typename T, int NV>
void delta(View<T> q, View<T> k, View<T> v, View<T> beta, const double* gate, int64_t gate_row, int64_t gate_token,
           int64_t gates, T* kv, View<T> out, int64_t rows, int64_t n, int64_t features, bool elu, bool unit) {
  using V = typename Lanes<T>::vec;
  constexpr int dv = NV * Lanes<T>::count;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<V> state(features * NV);
    std::vector<T> now(features), next(features), recall(features), rows_buffer(3 * features);
    T* query_buffer = rows_buffer.data();
    T* key_buffers[2] = {rows_buffer.data() + features, rows_buffer.data() + 2 * features};
    for (int64_t r = begin; r < end; ++r) {
      V* S = state.data();
      T* row_kv = kv + r * features * dv;
      for (int64_t f = 0; f < features; ++f) load_row<T, NV>(S + f * NV, row_kv + f * dv);
      const double* g = gate != nullptr ? gate + r * gate_row : nullptr;
      const T* b = beta.at(r, 0);
      // S^T (a_0 * k_0) for the first token: each later one is summed in the pass before it
      V recalled[NV];
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) recalled[j] = V{};
      factors(now.data(), g, gates, features);
      const T* key = nullptr;  // token t's key row, prepared in the pass before (never for a token that writes nothing)
      int slot = 0;
      if (n > 0 && b[0] != T(0)) {
        key = prepare(key_buffers[slot], k.at(r, 0), features, elu, unit);
        for (int64_t f = 0; f < features; ++f) {
          const T c = now[f] * key[f];
#pragma GCC unroll 16
          for (int j = 0; j < NV; ++j) recalled[j] += c * S[f * NV + j];
        }
      }
      for (int64_t t = 0; t < n; ++t) {
        const T strength = b[t * beta.token];
        const bool writes = strength != T(0);  // a masked token writes nothing (its key is never read)
        V u[NV], o[NV], ahead[NV];
        if (writes) {
          V value[NV];
          load_row<T, NV>(value, v.at(r, t));
#pragma GCC unroll 16
          for (int j = 0; j < NV; ++j) u[j] = strength * (value[j] - recalled[j]);
        }
#pragma GCC unroll 16
        for (int j = 0; j < NV; ++j) o[j] = ahead[j] = V{};
        // the next token's recall S_t^T (a_{t+1} * k_{t+1}) is summed in this token's pass over S
        const bool recalls = t + 1 < n && b[(t + 1) * beta.token] != T(0);
        if (t + 1 < n) factors(next.data(), g != nullptr ? g + (t + 1) * gate_token : nullptr, gates, features);
        const T* following = nullptr;
        if (recalls) {
          following = prepare(key_buffers[1 - slot], k.at(r, t + 1), features, elu, unit);
          for (int64_t f = 0; f < features; ++f) recall[f] = next[f] * following[f];
        }
        const T* query = prepare(query_buffer, q.at(r, t), features, elu, unit);
        for (int64_t f = 0; f < features; ++f) {
          V* s = S + f * NV;
          const T a = now[f], written = writes ? key[f] : T(0), read = query[f], c = recalls ? recall[f] : T(0);
#pragma GCC unroll 16
          for (int j = 0; j < NV; ++j) {
            V x = a * s[j];
            if (writes) x += written * u[j];
            s[j] = x;
            o[j] += read * x;
            ahead[j] += c * x;
          }
        }
        store_row<T, NV>(out.at(r, t), o, T(1));
#pragma GCC unroll 16
        for (int j = 0; j < NV; ++j) recalled[j] = ahead[j];
        now.swap(next);
        key = following;
        slot = 1 - slot;
      }
      for (int64_t f = 0; f < features; ++f) store_row<T, NV>(row_kv + f * dv, S + f * NV, T(1));
    }
  });
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
template <typename T, int NV, int FR>
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
      const T a = kt[i];
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) acc[i][j] += a * x[j];
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < FR; ++i) store_row<T, NV>(S + i * dv, acc[i], T(1));
}

// rank_strip over the last `rest` (< FR) feature rows, compiled for each count
template <typename T, int NV, int FR>
inline void rank_rest(int rest, T* S, const T* k, int64_t k_token, const T* v, int64_t v_token, int64_t tokens) {
  if constexpr (FR > 1) {
    if (rest == FR - 1) {
      rank_strip<T, NV, FR - 1>(S, k, k_token, v, v_token, tokens);
    } else {
      rank_rest<T, NV, FR - 1>(rest, S, k, k_token, v, v_token, tokens);
    }
  }
}

// accumulators a strip or tile keeps: 24 vectors (of 32 registers), 16 for the widest rows
template <int NV>
constexpr int tile_rows() {
  return NV >= 16 ? 1 : 24 / NV;
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

// Dv in vectors of 64 bytes, dispatched to a compiled width (the Python side admits only these)
#define LINATTN_VECTORS(vectors, ...)                       \
  switch (vectors) {                                        \
    case 1: { constexpr int NV = 1; __VA_ARGS__; break; }   \
    case 2: { constexpr int NV = 2; __VA_ARGS__; break; }   \
    case 4: { constexpr int NV = 4; __VA_ARGS__; break; }   \
    case 8: { constexpr int NV = 8; __VA_ARGS__; break; }   \
    case 16: { constexpr int NV = 16; __VA_ARGS__; break; } \
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
    LINATTN_VECTORS(vectors, delta<scalar_t, NV>(view<scalar_t>(qf), view<scalar_t>(kf), view<scalar_t>(v),
                                                 strengths, gate, gate_row, gate_token, gates,
                                                 kv.data_ptr<scalar_t>(), view<scalar_t>(out), rows, n, features,
                                                 elu, unit || elu));
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
// stack. Row r uses head r % H: weight_t (H, d, m) = W^T per head, bias (H, m); key_weight (R, n) or none.
template <typename T, int NV>
void hedgehog_map_rows(View<T> x, const T* weight_t, const T* bias, int64_t heads, const T* key_weight, T* out,
                       int64_t rows, int64_t n, int64_t d, double floor) {
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
          const T scale_row = key_weight == nullptr ? T(1) : key_weight[r * n + t0 + i];
          activate_row(z + i * m, out + (r * n + t0 + i) * 2 * m, m, scale_row, static_cast<T>(floor));
        }
      }
    }
  });
}

// x (R, n, d) last dimension contiguous; weight_t (H, d, m), bias (H, m) contiguous; key_weight (R, n) contiguous or
// none. Returns phi (R, n, 2m).
at::Tensor hedgehog_map(const at::Tensor& x, const at::Tensor& weight_t, const at::Tensor& bias,
                        const std::optional<at::Tensor>& key_weight, double floor) {
  const int64_t rows = x.size(0), n = x.size(1), d = x.size(2), heads = weight_t.size(0), m = weight_t.size(2);
  at::Tensor out = at::empty({rows, n, 2 * m}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "hedgehog_map", [&] {
    const int vectors = static_cast<int>(m / Lanes<scalar_t>::count);
    LINATTN_VECTORS(vectors, hedgehog_map_rows<scalar_t, NV>(
        view<scalar_t>(x), weight_t.data_ptr<scalar_t>(), bias.data_ptr<scalar_t>(), heads,
        key_weight ? key_weight->data_ptr<scalar_t>() : nullptr, out.data_ptr<scalar_t>(), rows, n, d, floor));
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
  m.def("noncausal_accumulate", &noncausal_accumulate, "non-causal: S += sum phi(k) v^T, z += sum phi(k) over a block");
  m.def("noncausal_read", &noncausal_read, "non-causal: out = S^T phi(q) / phi(q).z over a block of queries");
}

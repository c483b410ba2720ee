// One decoding token of the window beside a delta-rule memory, fused: linattn's native decoding core.
//
// The arithmetic of ComposedDecodeStep._delta_token after the feature stage (linattn/exact/composed_step.py, the
// reference this file is tested against), per batch row b and head h, with no allocation but the output:
//
//   S <- diag(a) S                      a = exp(log_decay): one factor per head, or one per feature (KDA)
//   u  = beta_out (v_out - S^T kf)      the key leaving the window writes (its slot's value, beta times kept)
//   S <- S + kf u^T
//   lin = S^T qf
//   the new token takes the leaving key's ring slot (key, value, kept = true, beta)
//   A  = softmax over the exact keys (kept and live slots) of scale * q . key, times their values
//   out = lin + gamma A                 (gamma = 1 when absent)
//
// Loops are written so that the compiler vectorises them (contiguous inner dimensions, `omp simd` reductions);
// heads run in parallel with torch's thread pool. Nothing here checks its inputs: the Python caller does, once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/python.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <limits>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

template <typename T>
T dot(const T* a, const T* b, int64_t n) {
  T acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// The sparse exact cache beside the window (SparseComposedDecodeStep, between two boundaries): the leaving key stays
// exact (writes nothing) where `stays` says the last boundary kept it, and the softmax also runs over the cached
// pairs of the row's cache row (`rows`: its index among the rows with a budget, or -1) whose positions p satisfy
// 0 <= p <= limit (those that have left the window); `weight` scales the memory's read-out per row.
struct Cache {
  const bool* stays = nullptr;         // (B*H,), entries stays_row apart
  int64_t stays_row = 1;
  const int64_t* rows = nullptr;       // (B*H,)
  const int64_t* positions = nullptr;  // (R_c, lambda)
  const void* keys = nullptr;          // (R_c, lambda, d)
  const void* values = nullptr;        // (R_c, lambda, Dv)
  const void* weight = nullptr;        // (B*H,) or null
  int64_t slots = 0, limit = -1;
};

// The Cache of a call's arguments: stays read from entry `stays_col` on, rows `stays.size(-1)` entries apart (a
// column (B*H,): 1)
Cache cache_of(const at::Tensor& stays, int64_t stays_col, const at::Tensor& rows, const at::Tensor& positions,
               const at::Tensor& cached_keys, const at::Tensor& cached_values, int64_t limit,
               const std::optional<at::Tensor>& weight) {
  Cache cache;
  cache.stays = stays.data_ptr<bool>() + stays_col;
  cache.stays_row = stays.dim() > 1 ? stays.size(-1) : 1;
  cache.rows = rows.data_ptr<int64_t>();
  cache.positions = positions.data_ptr<int64_t>();
  cache.keys = cached_keys.data_ptr();
  cache.values = cached_values.data_ptr();
  cache.weight = weight ? weight->data_ptr() : nullptr;
  cache.slots = positions.size(-1);
  cache.limit = limit;
  return cache;
}

// The ring of one decoding step: slot s of row r at (r * slots + s); live (slots,) shared by the rows.
template <typename T>
struct Ring {
  T* keys;
  T* values;
  bool* kept;
  const bool* live;
  T* betas;
  int64_t slots, dim, dv;
};

// One row's token after its feature stage: S (F x Dv) of the row, its unit query features, the leaving key's
// (null: no write), its log-decay (`gates` entries, null: none), the new key and value (the row's key head's),
// the new token's beta, the raw query; `gamma` the window's factor, `read` the memory's read-out weight. Scratch:
// recalled (Dv), scores (slots + cache slots), factor (F).
template <typename T>
void token_row(int64_t row, T* S, const T* qrow, const T* krow, const double* g, int64_t gates, const T* knew,
               const T* vnew, T beta_new, const T* qraw, T gamma, T read, T scale, int64_t slot, const Ring<T>& ring,
               int64_t features, const Cache& cache, T* recalled, T* scores, T* factor, T* o) {
  const int64_t slots = ring.slots, dim = ring.dim, dv = ring.dv;
  const T* cached_keys = static_cast<const T*>(cache.keys);
  const T* cached_values = static_cast<const T*>(cache.values);
  T* key_slots = ring.keys + row * slots * dim;
  T* value_slots = ring.values + row * slots * dv;
  bool* kept_p = ring.kept + row * slots;
  const bool* live_p = ring.live;
  // the decay: one factor per row of S (per head: the same for every row)
  if (g != nullptr) {
    if (gates == 1) {
      const T a = static_cast<T>(std::exp(g[0]));
      for (int64_t f = 0; f < features; ++f) factor[f] = a;
    } else {
      for (int64_t f = 0; f < features; ++f) factor[f] = static_cast<T>(std::exp(g[f]));
    }
  } else {
    for (int64_t f = 0; f < features; ++f) factor[f] = T(1);
  }
  // the leaving key's write: u = beta (v - (diag(a) S)^T kf); then S <- diag(a) S + kf u^T and the read S^T qf.
  // S is read once for u (not written: the decay is applied on the way) and once more to update and read it.
  const bool writes = krow != nullptr && kept_p[slot]  // a masked key: its features unread
                      && (cache.stays == nullptr || !cache.stays[row * cache.stays_row]);
  const T strength = writes ? ring.betas[row * slots + slot] : T(0);
  if (writes) {
    for (int64_t j = 0; j < dv; ++j) recalled[j] = T(0);
    for (int64_t f = 0; f < features; ++f) {
      const T* s = S + f * dv;
      const T ka = krow[f] * factor[f];
#pragma omp simd
      for (int64_t j = 0; j < dv; ++j) recalled[j] += ka * s[j];
    }
    const T* old = value_slots + slot * dv;
    for (int64_t j = 0; j < dv; ++j) recalled[j] = strength * (old[j] - recalled[j]);  // u
  }
  for (int64_t j = 0; j < dv; ++j) o[j] = T(0);
  for (int64_t f = 0; f < features; ++f) {
    T* s = S + f * dv;
    const T a = factor[f];
    const T qv = read * qrow[f];
    if (writes) {
      const T kv = krow[f];
#pragma omp simd
      for (int64_t j = 0; j < dv; ++j) {
        s[j] = a * s[j] + kv * recalled[j];
        o[j] += qv * s[j];
      }
    } else if (g != nullptr) {
#pragma omp simd
      for (int64_t j = 0; j < dv; ++j) {
        s[j] *= a;
        o[j] += qv * s[j];
      }
    } else {
#pragma omp simd
      for (int64_t j = 0; j < dv; ++j) o[j] += qv * s[j];
    }
  }
  // the new token takes the ring slot
  for (int64_t i = 0; i < dim; ++i) key_slots[slot * dim + i] = knew[i];
  for (int64_t j = 0; j < dv; ++j) value_slots[slot * dv + j] = vnew[j];
  kept_p[slot] = true;
  ring.betas[row * slots + slot] = beta_new;
  // the window's softmax average over the exact keys
  T top = -std::numeric_limits<T>::infinity();
  for (int64_t s = 0; s < slots; ++s) {
    if (kept_p[s] && live_p[s]) {
      scores[s] = dot(qraw, key_slots + s * dim, dim) * scale;
      top = scores[s] > top ? scores[s] : top;
    }
  }
  // the cached pairs that have left the window: after the ring's scores (-inf where not exact)
  const int64_t held = cache.rows != nullptr ? cache.rows[row] : -1;
  const int64_t* where = held >= 0 ? cache.positions + held * cache.slots : nullptr;
  T* cached = scores + slots;
  if (where != nullptr) {
    const T* ck = cached_keys + held * cache.slots * dim;
    for (int64_t c = 0; c < cache.slots; ++c) {
      if (where[c] >= 0 && where[c] <= cache.limit) {
        cached[c] = dot(qraw, ck + c * dim, dim) * scale;
        top = cached[c] > top ? cached[c] : top;
      }
    }
  }
  T total = 0;
  for (int64_t s = 0; s < slots; ++s) {
    const bool exact = kept_p[s] && live_p[s];
    scores[s] = exact ? std::exp(scores[s] - top) : T(0);
    total += scores[s];
  }
  if (where != nullptr) {
    for (int64_t c = 0; c < cache.slots; ++c) {
      cached[c] = where[c] >= 0 && where[c] <= cache.limit ? std::exp(cached[c] - top) : T(0);
      total += cached[c];
    }
  }
  const T weight = gamma / total;
  for (int64_t s = 0; s < slots; ++s) {
    if (scores[s] == T(0)) continue;
    const T w = scores[s] * weight;
    const T* val = value_slots + s * dv;
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) o[j] += w * val[j];
  }
  if (where != nullptr) {
    const T* cv = cached_values + held * cache.slots * dv;
    for (int64_t c = 0; c < cache.slots; ++c) {
      if (cached[c] == T(0)) continue;
      const T w = cached[c] * weight;
#pragma omp simd
      for (int64_t j = 0; j < dv; ++j) o[j] += w * cv[c * dv + j];
    }
  }
}

template <typename T>
Ring<T> ring_of(at::Tensor& keys, at::Tensor& values, at::Tensor& kept, at::Tensor& live, at::Tensor& betas) {
  return Ring<T>{keys.data_ptr<T>(), values.data_ptr<T>(), kept.data_ptr<bool>(), live.data_ptr<bool>(),
                 betas.data_ptr<T>(), keys.size(-2), keys.size(-1), values.size(-1)};
}

template <typename T>
void token(at::Tensor& memory, const at::Tensor& qf, const std::optional<at::Tensor>& kf,
           const std::optional<at::Tensor>& log_decay, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
           const at::Tensor& beta_new, at::Tensor& keys, at::Tensor& values, at::Tensor& kept, at::Tensor& live,
           at::Tensor& betas, int64_t slot, const std::optional<at::Tensor>& gamma, double scale, at::Tensor& out,
           const Cache& cache = Cache()) {
  const int64_t batch = memory.size(0), heads = memory.size(1), features = memory.size(2), dv = memory.size(3);
  const int64_t dim = q.size(-1), kv_heads = k.size(1), group = heads / kv_heads;
  const T* read_weight = static_cast<const T*>(cache.weight);
  const int64_t gates = log_decay ? log_decay->size(-1) : 0;
  T* mem = memory.data_ptr<T>();
  const T* qf_p = qf.data_ptr<T>();
  const T* kf_p = kf ? kf->data_ptr<T>() : nullptr;
  const double* gate_p = log_decay ? log_decay->data_ptr<double>() : nullptr;
  const T* q_p = q.data_ptr<T>();
  const T* k_p = k.data_ptr<T>();
  const T* v_p = v.data_ptr<T>();
  const T* beta_p = beta_new.data_ptr<T>();
  live.data_ptr<bool>()[slot] = true;  // the new token's slot holds an exact key from now on
  const Ring<T> ring = ring_of<T>(keys, values, kept, live, betas);
  const T* gamma_p = gamma ? gamma->data_ptr<T>() : nullptr;
  T* out_p = out.data_ptr<T>();
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> recalled(dv), scores(ring.slots + cache.slots), factor(features);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / heads, h = row % heads, kv_row = b * kv_heads + h / group;
      token_row<T>(row, mem + row * features * dv, qf_p + row * features,
                   kf_p != nullptr ? kf_p + row * features : nullptr,
                   gate_p != nullptr ? gate_p + row * gates : nullptr, gates, k_p + kv_row * dim, v_p + kv_row * dv,
                   beta_p[row], q_p + row * dim, gamma_p != nullptr ? gamma_p[row] : T(1),
                   read_weight != nullptr ? read_weight[row] : T(1), static_cast<T>(scale), slot, ring, features,
                   cache, recalled.data(), scores.data(), factor.data(), out_p + row * dv);
    }
  });
}

at::Tensor delta_window_token(at::Tensor memory, const at::Tensor& qf, const std::optional<at::Tensor>& kf,
                              const std::optional<at::Tensor>& log_decay, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& v, const at::Tensor& beta_new, at::Tensor keys, at::Tensor values,
                              at::Tensor kept, at::Tensor live, at::Tensor betas, int64_t slot,
                              const std::optional<at::Tensor>& gamma, double scale) {
  at::Tensor out = at::empty({memory.size(0), memory.size(1), 1, memory.size(3)}, memory.options());
  AT_DISPATCH_FLOATING_TYPES(memory.scalar_type(), "delta_window_token", [&] {
    token<scalar_t>(memory, qf, kf, log_decay, q, k, v, beta_new, keys, values, kept, live, betas, slot, gamma,
                    scale, out);
  });
  return out;
}

// delta_window_token beside the sparse exact cache (see Cache): stays (B*H,) bool, rows (B*H,) int64, positions
// (R_c, lambda) int64, cached keys (R_c, lambda, d) and values (R_c, lambda, Dv) in the memory's dtype, limit = t - W;
// weight (B*H,) or None. The ring tensors may be (B*H, slots, ...) as well as (B, H, slots, ...).
at::Tensor sparse_delta_token(at::Tensor memory, const at::Tensor& qf, const std::optional<at::Tensor>& kf,
                              const std::optional<at::Tensor>& log_decay, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& v, const at::Tensor& beta_new, at::Tensor keys, at::Tensor values,
                              at::Tensor kept, at::Tensor live, at::Tensor betas, int64_t slot,
                              const std::optional<at::Tensor>& gamma, double scale, const at::Tensor& stays,
                              const at::Tensor& rows, const at::Tensor& positions, const at::Tensor& cached_keys,
                              const at::Tensor& cached_values, int64_t limit, const std::optional<at::Tensor>& weight) {
  at::Tensor out = at::empty({memory.size(0), memory.size(1), 1, memory.size(3)}, memory.options());
  const Cache cache = cache_of(stays, 0, rows, positions, cached_keys, cached_values, limit, weight);
  AT_DISPATCH_FLOATING_TYPES(memory.scalar_type(), "sparse_delta_token", [&] {
    token<scalar_t>(memory, qf, kf, log_decay, q, k, v, beta_new, keys, values, kept, live, betas, slot, gamma,
                    scale, out, cache);
  });
  return out;
}

// The Hedgehog map of one token per (b, h), unit-normalised (linattn.feature_maps.HedgehogFeatureMap.features,
// then linattn.features.unit_rows): z = W x + b, phi = [softmax(z), softmax(-z)]; keys phi e^{clamp(u.x)} + floor,
// queries phi + floor; then f / max(|f|, 1e-12). x (B, H, d); weight (H | 1, m, d), bias (H | 1, m), u (H | 1, d).
// one row x (d) of it: w (m, d) and b (m) the row's head's, u (d) its key weight's (null: a query); z scratch (m)
template <typename T>
void hedgehog_row(const T* xr, const T* w, const T* b, const T* u, int64_t m, int64_t dim, double limit,
                  double floor, T* f, T* z) {
  T top = -std::numeric_limits<T>::infinity(), bottom = std::numeric_limits<T>::infinity();
  for (int64_t i = 0; i < m; ++i) {
    z[i] = dot(w + i * dim, xr, dim) + b[i];
    top = z[i] > top ? z[i] : top;
    bottom = z[i] < bottom ? z[i] : bottom;
  }
  T up = 0, down = 0;
  for (int64_t i = 0; i < m; ++i) {
    f[i] = std::exp(z[i] - top);
    f[m + i] = std::exp(bottom - z[i]);
    up += f[i];
    down += f[m + i];
  }
  T scale = T(1);
  if (u != nullptr) {  // a key: its learned weight e^{u.k}, u.k clipped to +-limit
    T logit = dot(u, xr, dim);
    logit = std::min(std::max(logit, static_cast<T>(-limit)), static_cast<T>(limit));
    scale = std::exp(logit);
  }
  T norm = 0;
  for (int64_t i = 0; i < m; ++i) {
    f[i] = static_cast<T>(floor) + (f[i] / up) * scale;
    f[m + i] = static_cast<T>(floor) + (f[m + i] / down) * scale;
    norm += f[i] * f[i] + f[m + i] * f[m + i];
  }
  const T inverse = T(1) / std::max(std::sqrt(norm), static_cast<T>(1e-12));
  for (int64_t i = 0; i < 2 * m; ++i) f[i] *= inverse;
}

template <typename T>
void hedgehog(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
              const std::optional<at::Tensor>& gate, double limit, double floor, at::Tensor& out) {
  const int64_t batch = x.size(0), heads = x.size(1), dim = x.size(2), m = weight.size(1);
  const bool shared = weight.size(0) == 1;
  const T* x_p = x.data_ptr<T>();
  const T* w_p = weight.data_ptr<T>();
  const T* b_p = bias.data_ptr<T>();
  const T* u_p = gate ? gate->data_ptr<T>() : nullptr;
  T* out_p = out.data_ptr<T>();
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> z(m);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t h = shared ? 0 : row % heads;
      hedgehog_row<T>(x_p + row * dim, w_p + h * m * dim, b_p + h * m, u_p != nullptr ? u_p + h * dim : nullptr, m,
                      dim, limit, floor, out_p + row * 2 * m, z.data());
    }
  });
}

at::Tensor hedgehog_unit_features(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                  const std::optional<at::Tensor>& gate, double limit, double floor) {
  at::Tensor out = at::empty({x.size(0), x.size(1), 1, 2 * weight.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "hedgehog_unit_features", [&] {
    hedgehog<scalar_t>(x, weight, bias, gate, limit, floor, out);
  });
  return out;
}

// A token's write strength and per-head log-gate from its keys (linattn.nn.KeyGates with gate="token"):
// u = log1p(sqrt(k_i^2 + k_{i+d/2}^2 + 1e-12)), beta = sigmoid(u.w_b + b_b), g = logsigmoid(u.w_g + b_g), each key
// head's pair repeated over its group of query heads. k (B, Hkv, d) -> beta (B, H), g (B, H).
// one key row kr (d) of key head h: its beta and log-gate; u scratch (d/2)
template <typename T>
void gate_row(const T* kr, int64_t half, const T* beta_w, T beta_b, const T* gate_w, T gate_b, T* u, T& s, T& g) {
  for (int64_t i = 0; i < half; ++i) u[i] = std::log1p(std::sqrt(kr[i] * kr[i] + kr[half + i] * kr[half + i] + T(1e-12)));
  const T strength = dot(u, beta_w, half) + beta_b;
  const T logit = dot(u, gate_w, half) + gate_b;
  s = T(1) / (T(1) + std::exp(-strength));
  g = std::min(logit, T(0)) - std::log1p(std::exp(-std::abs(logit)));
}

template <typename T>
void gates(const at::Tensor& k, const at::Tensor& beta_w, const at::Tensor& beta_b, const at::Tensor& gate_w,
           const at::Tensor& gate_b, at::Tensor& beta, at::Tensor& log_gate) {
  const int64_t batch = k.size(0), kv_heads = k.size(1), dim = k.size(2), half = dim / 2;
  const int64_t heads = beta.size(1), group = heads / kv_heads;
  const T* k_p = k.data_ptr<T>();
  std::vector<T> u(half);
  for (int64_t row = 0; row < batch * kv_heads; ++row) {
    const int64_t h = row % kv_heads, b = row / kv_heads;
    T s, g;
    gate_row<T>(k_p + row * dim, half, beta_w.data_ptr<T>() + h * half, beta_b.data_ptr<T>()[h],
                gate_w.data_ptr<T>() + h * half, gate_b.data_ptr<T>()[h], u.data(), s, g);
    for (int64_t j = 0; j < group; ++j) {
      beta.data_ptr<T>()[b * heads + h * group + j] = s;
      log_gate.data_ptr<T>()[b * heads + h * group + j] = g;
    }
  }
}

std::tuple<at::Tensor, at::Tensor> key_gates(const at::Tensor& k, const at::Tensor& beta_w, const at::Tensor& beta_b,
                                             const at::Tensor& gate_w, const at::Tensor& gate_b, int64_t heads) {
  at::Tensor beta = at::empty({k.size(0), heads}, k.options());
  at::Tensor log_gate = at::empty({k.size(0), heads}, k.options());
  AT_DISPATCH_FLOATING_TYPES(k.scalar_type(), "key_gates", [&] {
    gates<scalar_t>(k, beta_w, beta_b, gate_w, gate_b, beta, log_gate);
  });
  return {beta, log_gate};
}

// One decoding token of a layer's attention from its raw q (B, H, 1, d), k and v (B, Hkv, 1, .) to its output
// (B, H, 1, Dv), in one parallel region over the rows (b, h): the token's beta and log-gate from the key of the
// row's key head (gate_row, as key_gates; without gates the fixed beta (B*H,)), its log-decay the fixed rate's
// (log_rate (B*H,) fp64, or none) plus the gate's; the Hedgehog unit features of the query and, when it writes,
// of the key leaving the window (hedgehog_row: weights (H | 1, m, d), biases (H | 1, m), the key weight's u
// (H | 1, d)); then token_row. leaving = t - W: at or past the sinks its key writes (unless kept false, or the
// last boundary kept it: `stays` (B*H, W) at column stays_col); a sink (0 <= leaving < sinks) becomes a separate
// exact key. The sparse cache's arguments as sparse_delta_token's (all or none). The same arithmetic as the
// three calls key_gates, hedgehog_unit_features and delta_window_token / sparse_delta_token, the same results;
// with `readout` (Hkv,) the output times sigmoid(readout) of the row's key head (KeyGates' read-out weight),
// which the three calls leave to their caller.
at::Tensor layer_token(at::Tensor memory, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& q_weight, const at::Tensor& q_bias, const at::Tensor& k_weight,
                       const at::Tensor& k_bias, const at::Tensor& k_gate, double limit, double floor,
                       const std::optional<at::Tensor>& beta_w, const std::optional<at::Tensor>& beta_b,
                       const std::optional<at::Tensor>& gate_w, const std::optional<at::Tensor>& gate_b,
                       const std::optional<at::Tensor>& readout, const at::Tensor& fixed_beta,
                       const std::optional<at::Tensor>& log_rate, at::Tensor keys,
                       at::Tensor values, at::Tensor kept, at::Tensor live, at::Tensor betas, int64_t slot,
                       int64_t leaving, int64_t sinks, const std::optional<at::Tensor>& gamma, double scale,
                       const std::optional<at::Tensor>& stays, int64_t stays_col,
                       const std::optional<at::Tensor>& rows, const std::optional<at::Tensor>& positions,
                       const std::optional<at::Tensor>& cached_keys, const std::optional<at::Tensor>& cached_values,
                       int64_t limit_position, const std::optional<at::Tensor>& weight) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(-1), kv_heads = k.size(1);
  const int64_t group = heads / kv_heads, features = memory.size(-2), dv = memory.size(-1);
  const int64_t m = q_weight.size(1), half = dim / 2;
  at::Tensor out = at::empty({batch, heads, 1, dv}, memory.options());
  const Cache cache = rows ? cache_of(*stays, stays_col, *rows, *positions, *cached_keys, *cached_values,
                                      limit_position, weight)
                           : Cache();
  if (leaving >= 0 && leaving < sinks) live.data_ptr<bool>()[leaving] = true;  // a sink leaves the window
  live.data_ptr<bool>()[slot] = true;  // the new token's slot holds an exact key from now on
  const bool key_writes = leaving >= sinks;
  AT_DISPATCH_FLOATING_TYPES(memory.scalar_type(), "layer_token", [&] {
    using T = scalar_t;
    const Ring<T> ring = ring_of<T>(keys, values, kept, live, betas);
    const T* q_p = q.data_ptr<T>();
    const T* k_p = k.data_ptr<T>();
    const T* v_p = v.data_ptr<T>();
    const T *qw = q_weight.data_ptr<T>(), *qb = q_bias.data_ptr<T>();
    const T *kw = k_weight.data_ptr<T>(), *kb = k_bias.data_ptr<T>(), *ku = k_gate.data_ptr<T>();
    const bool q_shared = q_weight.size(0) == 1, k_shared = k_weight.size(0) == 1;
    const bool gated = beta_w.has_value();
    const T* bw = gated ? beta_w->data_ptr<T>() : nullptr;
    const T* bb = gated ? beta_b->data_ptr<T>() : nullptr;
    const T* gw = gated ? gate_w->data_ptr<T>() : nullptr;
    const T* gb = gated ? gate_b->data_ptr<T>() : nullptr;
    const T* ro = readout ? readout->data_ptr<T>() : nullptr;
    const T* fixed = fixed_beta.data_ptr<T>();
    const double* rate = log_rate ? log_rate->data_ptr<double>() : nullptr;
    const T* gamma_p = gamma ? gamma->data_ptr<T>() : nullptr;
    const T* read_weight = static_cast<const T*>(cache.weight);
    T* mem = memory.data_ptr<T>();
    T* out_p = out.data_ptr<T>();
    at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<T> z(m), qf(features), kf(features), u(std::max<int64_t>(half, 1)), recalled(dv);
      std::vector<T> scores(ring.slots + cache.slots), factor(features);
      for (int64_t row = begin; row < end; ++row) {
        const int64_t b = row / heads, h = row % heads, head_kv = h / group, kv_row = b * kv_heads + head_kv;
        T beta_new = fixed[row];
        double g[1];
        const double* g_p = nullptr;
        if (gated) {
          T strength, gate;
          gate_row<T>(k_p + kv_row * dim, half, bw + head_kv * half, bb[head_kv], gw + head_kv * half, gb[head_kv],
                      u.data(), strength, gate);
          beta_new = strength;
          g[0] = rate != nullptr ? rate[row] + static_cast<double>(gate) : static_cast<double>(gate);
          g_p = g;
        } else if (rate != nullptr) {
          g[0] = rate[row];
          g_p = g;
        }
        const int64_t hq = q_shared ? 0 : h, hk = k_shared ? 0 : h;
        hedgehog_row<T>(q_p + row * dim, qw + hq * m * dim, qb + hq * m, nullptr, m, dim, limit, floor, qf.data(),
                        z.data());
        const bool writes = key_writes && ring.kept[row * ring.slots + slot]
                            && (cache.stays == nullptr || !cache.stays[row * cache.stays_row]);
        if (writes)
          hedgehog_row<T>(ring.keys + (row * ring.slots + slot) * dim, kw + hk * m * dim, kb + hk * m,
                          ku + hk * dim, m, dim, limit, floor, kf.data(), z.data());
        // the output times sigmoid(readout) of the key head: gamma and the read-out weight times it
        const T times = ro != nullptr ? T(1) / (T(1) + std::exp(-ro[head_kv])) : T(1);
        token_row<T>(row, mem + row * features * dv, qf.data(), writes ? kf.data() : nullptr, g_p, 1,
                     k_p + kv_row * dim, v_p + kv_row * dv, beta_new, q_p + row * dim,
                     times * (gamma_p != nullptr ? gamma_p[row] : T(1)),
                     times * (read_weight != nullptr ? read_weight[row] : T(1)),
                     static_cast<T>(scale), slot, ring, features, cache, recalled.data(), scores.data(),
                     factor.data(), out_p + row * dv);
      }
    });
  });
  return out;
}


// A linear layer on a few tokens (decoding): y = x W^T + b for x (..., in) holding a few rows, W (out, in)
// contiguous as nn.Linear keeps it; y (..., out). A token's matrix-vector products read every weight once and do
// two flops per 4 bytes, so their speed is the memory's: the output rows are split over torch's threads, each row
// of W streamed once against the rows of x (which stay in the first-level cache).
at::Tensor linear_token(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const at::Tensor x = input.contiguous();
  const int64_t in = weight.size(1), out = weight.size(0), tokens = x.numel() / in;
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = out;
  at::Tensor y = at::empty(sizes, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "linear_token", [&] {
    using T = scalar_t;
    const T* x_p = x.data_ptr<T>();
    const T* w_p = weight.data_ptr<T>();
    const T* b_p = bias ? bias->data_ptr<T>() : nullptr;
    T* y_p = y.data_ptr<T>();
    at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* row = w_p + r * in;
        const T shift = b_p ? b_p[r] : T(0);
        for (int64_t t = 0; t < tokens; ++t) y_p[t * out + r] = dot(row, x_p + t * in, in) + shift;
      }
    });
  });
  return y;
}


// linear_token with W held as blocks of 32 weights along each row, w = d * q + m (q an integer code, d and m one
// fp32 scale and offset per block; m absent: 0): the block formats of GGUF files (Q4_1: q in 0..15; Q8_0: q a signed
// byte, no offset). Each block's weights are formed in fp32 as the fp32 model has them (d * q is exact: d has an fp16
// significand and q at most 8 bits, so only the + m rounds, as it does in the model's own copy, fused or not), then
// multiplied with x: the same weights, read as 4.5 or 8.5 bits each instead of 32. `in` is a multiple of 32; x, the
// codes, d and m contiguous.
//
// The 4-bit codes of a row (BlockWeights in token_linear.py packs them) come in groups of two blocks, 64 weights:
// eight 32-bit words, word i holding in its bits 4k..4k+3 the code of weight 8k + i of the group (k = 0..7), so
// that one shift and one mask give the codes of eight consecutive weights in the eight lanes of an AVX2 register
// (no byte shuffles: they bound the speed of the earlier layout). An odd last block is a half group: eight 16-bit
// words, k = 0..3. A row's codes take blocks * 16 bytes either way. Q8_0's codes are the block's 32 bytes in order.
constexpr int64_t kBlock = 32, kBlockTokens = 8;

// the code of weight j (0..31) of block b in a row of 4-bit codes packed as above
inline int nibble_code(const uint8_t* row, int64_t blocks, int64_t b, int64_t j) {
  const int64_t group = b / 2, k = 4 * (b % 2) + j / 8, i = j % 8;
  const uint8_t* base = row + group * 32;
  uint32_t word;
  if (2 * group + 1 < blocks) {  // a whole group: 32-bit words
    std::memcpy(&word, base + 4 * i, 4);
  } else {  // the half group of an odd last block: 16-bit words
    uint16_t half;
    std::memcpy(&half, base + 2 * i, 2);
    word = half;
  }
  return static_cast<int>((word >> (4 * k)) & 15u);
}

// one block's 32 weights from its codes (the portable build's path)
inline void block_weights(const uint8_t* row, int64_t blocks, int64_t b, bool nibbles, float d, float m, float* w) {
  if (nibbles) {
    for (int64_t j = 0; j < kBlock; ++j) w[j] = d * static_cast<float>(nibble_code(row, blocks, b, j)) + m;
  } else {
    const int8_t* q = reinterpret_cast<const int8_t*>(row + b * kBlock);
    for (int64_t j = 0; j < kBlock; ++j) w[j] = d * static_cast<float>(q[j]) + m;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
inline float horizontal_sum(__m256 v) {
  const __m128 pair = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(pair, _mm_movehl_ps(pair, pair));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}

// one block of a row of 4-bit codes: its codes the nibbles K0..K0+3 of `words`, its x at xs (token t at t * in)
template <int TOKENS, bool OFFSET, int K0>
inline void nibble_block(__m256i words, float d, float m, const float* xs, int64_t in, int64_t tokens,
                         __m256 (*acc)[2]) {
  const __m256i mask = _mm256_set1_epi32(15);
  const __m256 scale = _mm256_set1_ps(d), offset = _mm256_set1_ps(m);
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    const __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(words, 4 * (K0 + k)), mask));
    const __m256 w = OFFSET ? _mm256_fmadd_ps(scale, q, offset) : _mm256_mul_ps(scale, q);
    for (int t = 0; t < TOKENS; ++t) {
      if (t >= tokens) break;
      acc[t][k & 1] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xs + t * in + 8 * k), acc[t][k & 1]);
    }
  }
}

// one output row of 4-bit codes for up to TOKENS tokens (``tokens`` of them): y[t * out] = x_t . w + shift
template <int TOKENS, bool OFFSET>
void nibble_row(const uint8_t* row, int64_t blocks, const float* d_row, const float* m_row, const float* x,
                int64_t in, float shift, float* y, int64_t out, int64_t tokens) {
  __m256 acc[TOKENS][2];
  for (int t = 0; t < TOKENS; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  const int64_t groups = blocks / 2;
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * 32));
    const int64_t b = 2 * g;
    nibble_block<TOKENS, OFFSET, 0>(words, d_row[b], OFFSET ? m_row[b] : 0.0f, x + b * kBlock, in, tokens, acc);
    nibble_block<TOKENS, OFFSET, 4>(words, d_row[b + 1], OFFSET ? m_row[b + 1] : 0.0f, x + (b + 1) * kBlock, in,
                                    tokens, acc);
  }
  if (blocks % 2) {  // the half group: eight 16-bit words
    const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + groups * 32)));
    const int64_t b = blocks - 1;
    nibble_block<TOKENS, OFFSET, 0>(words, d_row[b], OFFSET ? m_row[b] : 0.0f, x + b * kBlock, in, tokens, acc);
  }
  for (int t = 0; t < TOKENS && t < tokens; ++t)
    y[t * out] = horizontal_sum(_mm256_add_ps(acc[t][0], acc[t][1])) + shift;
}

// one output row of byte codes (Q8_0 and any other 8-bit kind)
template <int TOKENS, bool OFFSET>
void byte_row(const uint8_t* row, int64_t blocks, const float* d_row, const float* m_row, const float* x,
              int64_t in, float shift, float* y, int64_t out, int64_t tokens) {
  __m256 acc[TOKENS][4];
  for (int t = 0; t < TOKENS; ++t)
    for (int i = 0; i < 4; ++i) acc[t][i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* codes = row + b * kBlock;
    const __m256 scale = _mm256_broadcast_ss(d_row + b);
    const __m256 offset = OFFSET ? _mm256_broadcast_ss(m_row + b) : _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      const __m256 q = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * i))));
      const __m256 w = OFFSET ? _mm256_fmadd_ps(scale, q, offset) : _mm256_mul_ps(scale, q);
      for (int t = 0; t < TOKENS; ++t) {
        if (t >= tokens) break;
        acc[t][i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + t * in + b * kBlock + 8 * i), acc[t][i]);
      }
    }
  }
  for (int t = 0; t < TOKENS && t < tokens; ++t)
    y[t * out] = horizontal_sum(_mm256_add_ps(_mm256_add_ps(acc[t][0], acc[t][1]),
                                              _mm256_add_ps(acc[t][2], acc[t][3]))) + shift;
}

// a row for its token count and block kind
template <bool NIBBLES, bool OFFSET>
void block_row_for(int64_t tokens, const uint8_t* row, int64_t blocks, const float* d_row, const float* m_row,
                   const float* x, int64_t in, float shift, float* y, int64_t out) {
  auto run = [&](auto count) {  // the token count a constant: the accumulators stay in registers
    constexpr int kTokens = decltype(count)::value;
    if (NIBBLES)
      nibble_row<kTokens, OFFSET>(row, blocks, d_row, m_row, x, in, shift, y, out, tokens);
    else
      byte_row<kTokens, OFFSET>(row, blocks, d_row, m_row, x, in, shift, y, out, tokens);
  };
  switch (tokens) {
    case 1: run(std::integral_constant<int, 1>()); break;
    case 2: run(std::integral_constant<int, 2>()); break;
    default: run(std::integral_constant<int, kBlockTokens>());
  }
}
#endif

at::Tensor linear_token_blocks(const at::Tensor& input, const at::Tensor& codes, const at::Tensor& scales,
                               const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias,
                               bool nibbles) {
  const at::Tensor x = input.contiguous();
  const int64_t out = scales.size(0), blocks = scales.size(1), in = blocks * kBlock, tokens = x.numel() / in;
  TORCH_CHECK(tokens >= 1 && tokens <= kBlockTokens, "linear_token_blocks: 1 to 8 rows");  // acc's bound
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = out;
  at::Tensor y = at::empty(sizes, x.options());
  const float* x_p = x.data_ptr<float>();
  const uint8_t* c_p = static_cast<const uint8_t*>(codes.data_ptr());
  const float* d_p = scales.data_ptr<float>();
  const float* m_p = mins ? mins->data_ptr<float>() : nullptr;
  const float* b_p = bias ? bias->data_ptr<float>() : nullptr;
  float* y_p = y.data_ptr<float>();
  const int64_t block_bytes = nibbles ? kBlock / 2 : kBlock, row_bytes = blocks * block_bytes;
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* row = c_p + r * row_bytes;
      const float* d_row = d_p + r * blocks;
      const float* m_row = m_p ? m_p + r * blocks : nullptr;
      const float shift = b_p ? b_p[r] : 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
      if (nibbles && m_row)
        block_row_for<true, true>(tokens, row, blocks, d_row, m_row, x_p, in, shift, y_p + r, out);
      else if (nibbles)
        block_row_for<true, false>(tokens, row, blocks, d_row, d_row, x_p, in, shift, y_p + r, out);
      else if (m_row)
        block_row_for<false, true>(tokens, row, blocks, d_row, m_row, x_p, in, shift, y_p + r, out);
      else
        block_row_for<false, false>(tokens, row, blocks, d_row, d_row, x_p, in, shift, y_p + r, out);
#else
      float acc[kBlockTokens][kBlock] = {};
      float w[kBlock];
      for (int64_t b = 0; b < blocks; ++b) {
        block_weights(row, blocks, b, nibbles, d_row[b], m_row ? m_row[b] : 0.0f, w);
        for (int64_t t = 0; t < tokens; ++t) {
          const float* xs = x_p + t * in + b * kBlock;
#pragma omp simd
          for (int64_t j = 0; j < kBlock; ++j) acc[t][j] += w[j] * xs[j];
        }
      }
      for (int64_t t = 0; t < tokens; ++t) {
        float sum = 0.0f;
        for (int64_t j = 0; j < kBlock; ++j) sum += acc[t][j];
        y_p[t * out + r] = sum + shift;
      }
#endif
    }
  });
  return y;
}


// A decoder layer of a Llama-architecture model for a decoding token (linattn.hf_decode): the RMSNorms, the
// projections, the rotary embedding, the residuals and the SwiGLU MLP around the attention, in two calls a layer
// (before and after the attention, which stays the decoding step's) instead of some twenty torch operations. The
// arithmetic is transformers' (modeling_llama): h = w * x / sqrt(mean(x^2) + eps) (the mean here in double),
// q' = q cos + rotate_half(q) sin, the MLP down(silu(gate(h)) * up(h)); the linear layers linear_token's or, where a
// weight is blocks of codes, linear_token_blocks'. Rows: the batch's tokens, one per row.

// One linear layer: (weight, bias, codes, scales, offsets, two codes a byte), as TokenLinear holds it
using TokenLinearSpec = std::tuple<at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>,
                                   std::optional<at::Tensor>, std::optional<at::Tensor>, bool>;

at::Tensor apply_linear(const TokenLinearSpec& spec, const at::Tensor& x) {
  const auto& [weight, bias, codes, scales, mins, nibbles] = spec;
  if (x.numel() / x.size(-1) > kBlockTokens) return at::linear(x, weight, bias);  // more rows: a GEMM's
  if (codes) return linear_token_blocks(x, *codes, *scales, mins, bias, nibbles);
  return linear_token(x, weight, bias);
}

// out = w * x / sqrt(mean(x^2) + eps), row by row (rows of n)
template <typename T>
void rms_rows(const T* x, const T* w, double eps, T* out, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * n;
    double sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(xr[i]) * xr[i];
    const T inverse = static_cast<T>(1.0 / std::sqrt(sum / static_cast<double>(n) + eps));
    for (int64_t i = 0; i < n; ++i) out[r * n + i] = w[i] * (xr[i] * inverse);
  }
}

at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_norm_rows", [&] {
    rms_rows<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), eps, out.data_ptr<scalar_t>(),
                       x.numel() / x.size(-1), x.size(-1));
  });
  return out;
}

// x (rows, heads * d) in place: each head's x cos + rotate_half(x) sin; cos and sin (rows | 1, d)
template <typename T>
void rotate_rows(T* x, const T* cos, const T* sin, int64_t rows, int64_t heads, int64_t d, bool shared) {
  const int64_t half = d / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const T* c = cos + (shared ? 0 : r * d);
    const T* s = sin + (shared ? 0 : r * d);
    for (int64_t h = 0; h < heads; ++h) {
      T* v = x + (r * heads + h) * d;
      for (int64_t i = 0; i < half; ++i) {
        const T a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
  }
}

class DecoderLayers {
 public:
  // linears: 7 a layer (q, k, v, o, gate, up, down), then the LM head; norms: 2 a layer (input, post-attention),
  // then the final one
  DecoderLayers(std::vector<TokenLinearSpec> linears, std::vector<at::Tensor> norms, double eps, int64_t head_dim)
      : linears_(std::move(linears)), norms_(std::move(norms)), eps_(eps), head_dim_(head_dim) {
    TORCH_CHECK(linears_.size() % 7 == 1 && norms_.size() == 2 * (linears_.size() / 7) + 1,
                "DecoderLayers: 7 linear layers and 2 norms a layer, then the head and the final norm");
    for (const auto& spec : linears_) versions_.push_back(std::get<0>(spec)._version());
    for (const auto& norm : norms_) versions_.push_back(norm._version());
  }

  // whether every weight is as it was when these layers were made (none changed in place since)
  bool current() const {
    size_t i = 0;
    for (const auto& spec : linears_)
      if (std::get<0>(spec)._version() != versions_[i++]) return false;
    for (const auto& norm : norms_)
      if (norm._version() != versions_[i++]) return false;
    return true;
  }

  // x (B, 1, hidden) -> q (B, H, 1, d), k and v (B, Hkv, 1, d), q and k rotated (cos, sin (B | 1, 1, d))
  std::tuple<at::Tensor, at::Tensor, at::Tensor> pre(int64_t layer, const at::Tensor& x, const at::Tensor& cos,
                                                     const at::Tensor& sin) const {
    const at::Tensor h = rms_norm_rows(x, norms_[2 * layer], eps_);
    at::Tensor q = apply_linear(linears_[7 * layer], h).contiguous();
    at::Tensor k = apply_linear(linears_[7 * layer + 1], h).contiguous();
    at::Tensor v = apply_linear(linears_[7 * layer + 2], h).contiguous();
    const int64_t rows = x.numel() / x.size(-1), d = head_dim_;
    const bool shared = cos.numel() == d;
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "decoder_pre", [&] {
      rotate_rows<scalar_t>(q.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), rows,
                            q.size(-1) / d, d, shared);
      rotate_rows<scalar_t>(k.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), rows,
                            k.size(-1) / d, d, shared);
    });
    return {q.view({rows, -1, 1, d}), k.view({rows, -1, 1, d}), v.view({rows, -1, 1, d})};
  }

  // x + the attention's output (B, 1, H, dv) through o, then + the MLP of the post-attention norm: the next x
  at::Tensor post(int64_t layer, const at::Tensor& x, const at::Tensor& attention) const {
    const int64_t rows = x.numel() / x.size(-1);
    at::Tensor y = x + apply_linear(linears_[7 * layer + 3], attention.reshape({rows, 1, -1}));
    const at::Tensor h = rms_norm_rows(y, norms_[2 * layer + 1], eps_);
    at::Tensor gate = apply_linear(linears_[7 * layer + 4], h).contiguous();
    const at::Tensor up = apply_linear(linears_[7 * layer + 5], h).contiguous();
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "decoder_post", [&] {
      scalar_t* g = gate.data_ptr<scalar_t>();
      const scalar_t* u = up.data_ptr<scalar_t>();
      for (int64_t i = 0; i < gate.numel(); ++i) g[i] = g[i] / (scalar_t(1) + std::exp(-g[i])) * u[i];  // silu
    });
    y.add_(apply_linear(linears_[7 * layer + 6], gate));
    return y;
  }

  // the final norm and the LM head: logits (B, 1, vocab)
  at::Tensor head(const at::Tensor& x) const {
    return apply_linear(linears_.back(), rms_norm_rows(x, norms_.back(), eps_));
  }

 private:
  std::vector<TokenLinearSpec> linears_;
  std::vector<at::Tensor> norms_;
  std::vector<int64_t> versions_;
  double eps_;
  int64_t head_dim_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("delta_window_token", &delta_window_token,
        "one decoding token of the window beside a delta-rule memory (see decode.cpp)");
  m.def("sparse_delta_token", &sparse_delta_token,
        "delta_window_token beside the sparse exact cache, between two boundaries (see decode.cpp)");
  m.def("hedgehog_unit_features", &hedgehog_unit_features, "the Hedgehog map's unit features of one token");
  m.def("key_gates", &key_gates, "beta and a per-head log-gate of one token from its keys (KeyGates)");
  m.def("layer_token", &layer_token,
        "one decoding token of a layer's attention from its raw q, k, v: gates, maps and token fused (see decode.cpp)");
  m.def("linear_token", &linear_token, "x W^T + b for a few tokens x, rows of W over the threads (see decode.cpp)");
  m.def("linear_token_blocks", &linear_token_blocks,
        "linear_token with W as blocks of 32 codes, w = d q + m (GGUF's Q4_1 and Q8_0; see decode.cpp)");
  m.def("rms_norm_rows", &rms_norm_rows, "w * x / sqrt(mean(x^2) + eps) along the last dim (see decode.cpp)");
  pybind11::class_<DecoderLayers>(m, "DecoderLayers",
                                  "a Llama-architecture model's decoder layers for a decoding token (see decode.cpp)")
      .def(pybind11::init<std::vector<TokenLinearSpec>, std::vector<at::Tensor>, double, int64_t>())
      .def("current", &DecoderLayers::current)
      .def("pre", &DecoderLayers::pre)
      .def("post", &DecoderLayers::post)
      .def("head", &DecoderLayers::head);
}

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
#include <limits>
#include <optional>
#include <vector>

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
  const bool* stays = nullptr;         // (B*H,)
  const int64_t* rows = nullptr;       // (B*H,)
  const int64_t* positions = nullptr;  // (R_c, lambda)
  const void* keys = nullptr;          // (R_c, lambda, d)
  const void* values = nullptr;        // (R_c, lambda, Dv)
  const void* weight = nullptr;        // (B*H,) or null
  int64_t slots = 0, limit = -1;
};

template <typename T>
void token(at::Tensor& memory, const at::Tensor& qf, const std::optional<at::Tensor>& kf,
           const std::optional<at::Tensor>& log_decay, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
           const at::Tensor& beta_new, at::Tensor& keys, at::Tensor& values, at::Tensor& kept, at::Tensor& live,
           at::Tensor& betas, int64_t slot, const std::optional<at::Tensor>& gamma, double scale, at::Tensor& out,
           const Cache& cache = Cache()) {
  const int64_t batch = memory.size(0), heads = memory.size(1), features = memory.size(2), dv = memory.size(3);
  const int64_t dim = q.size(-1), slots = keys.size(-2), kv_heads = k.size(1), group = heads / kv_heads;
  const T* cached_keys = static_cast<const T*>(cache.keys);
  const T* cached_values = static_cast<const T*>(cache.values);
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
  T* keys_p = keys.data_ptr<T>();
  T* values_p = values.data_ptr<T>();
  bool* kept_p = kept.data_ptr<bool>();
  bool* live_p = live.data_ptr<bool>();
  live_p[slot] = true;  // the new token's slot holds an exact key from now on
  T* betas_p = betas.data_ptr<T>();
  const T* gamma_p = gamma ? gamma->data_ptr<T>() : nullptr;
  T* out_p = out.data_ptr<T>();
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> recalled(dv), scores(slots + cache.slots), factor(features);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / heads, h = row % heads, kv_row = b * kv_heads + h / group;
      T* S = mem + row * features * dv;
      const T* qrow = qf_p + row * features;
      T* o = out_p + row * dv;
      T* key_slots = keys_p + row * slots * dim;
      T* value_slots = values_p + row * slots * dv;
      // the decay: one factor per row of S (per head: the same for every row)
      if (gate_p != nullptr) {
        const double* g = gate_p + row * gates;
        if (gates == 1) {
          const T a = static_cast<T>(std::exp(g[0]));
          for (int64_t f = 0; f < features; ++f) factor[f] = a;
        } else {
          for (int64_t f = 0; f < features; ++f) factor[f] = static_cast<T>(std::exp(g[f]));
        }
      } else {
        for (int64_t f = 0; f < features; ++f) factor[f] = T(1);
      }
      // the leaving key's write: u = beta (v - S^T kf) after the decay; then S += kf u^T and the read S^T qf
      const bool writes = kf_p != nullptr && kept_p[row * slots + slot]  // a masked key: its features unread
                          && (cache.stays == nullptr || !cache.stays[row]);
      const T strength = writes ? betas_p[row * slots + slot] : T(0);
      for (int64_t j = 0; j < dv; ++j) recalled[j] = T(0);
      const T* krow = writes ? kf_p + row * features : nullptr;
      for (int64_t f = 0; f < features; ++f) {
        T* s = S + f * dv;
        const T a = factor[f];
        if (writes) {
          const T kv = krow[f];
#pragma omp simd
          for (int64_t j = 0; j < dv; ++j) {
            s[j] *= a;
            recalled[j] += kv * s[j];
          }
        } else if (gate_p != nullptr) {
#pragma omp simd
          for (int64_t j = 0; j < dv; ++j) s[j] *= a;
        }
      }
      for (int64_t j = 0; j < dv; ++j) o[j] = T(0);
      if (writes) {
        const T* old = value_slots + slot * dv;
        for (int64_t j = 0; j < dv; ++j) recalled[j] = strength * (old[j] - recalled[j]);  // u
      }
      const T lin = read_weight != nullptr ? read_weight[row] : T(1);
      for (int64_t f = 0; f < features; ++f) {
        T* s = S + f * dv;
        const T qv = lin * qrow[f];
        if (writes) {
          const T kv = krow[f];
#pragma omp simd
          for (int64_t j = 0; j < dv; ++j) {
            s[j] += kv * recalled[j];
            o[j] += qv * s[j];
          }
        } else {
#pragma omp simd
          for (int64_t j = 0; j < dv; ++j) o[j] += qv * s[j];
        }
      }
      // the new token takes the ring slot
      const T* knew = k_p + kv_row * dim;
      const T* vnew = v_p + kv_row * dv;
      for (int64_t i = 0; i < dim; ++i) key_slots[slot * dim + i] = knew[i];
      for (int64_t j = 0; j < dv; ++j) value_slots[slot * dv + j] = vnew[j];
      kept_p[row * slots + slot] = true;
      betas_p[row * slots + slot] = beta_p[row];
      // the window's softmax average over the exact keys
      const T* qraw = q_p + row * dim;
      T top = -std::numeric_limits<T>::infinity();
      for (int64_t s = 0; s < slots; ++s) {
        if (kept_p[row * slots + s] && live_p[s]) {
          scores[s] = dot(qraw, key_slots + s * dim, dim) * static_cast<T>(scale);
          top = scores[s] > top ? scores[s] : top;
        }
      }
      // the cached pairs that have left the window: after the ring's scores (-inf where not exact)
      const int64_t held = cache.rows != nullptr ? cache.rows[row] : -1;
      const int64_t* where = held >= 0 ? cache.positions + held * cache.slots : nullptr;
      T* cached = scores.data() + slots;
      if (where != nullptr) {
        const T* ck = cached_keys + held * cache.slots * dim;
        for (int64_t c = 0; c < cache.slots; ++c) {
          if (where[c] >= 0 && where[c] <= cache.limit) {
            cached[c] = dot(qraw, ck + c * dim, dim) * static_cast<T>(scale);
            top = cached[c] > top ? cached[c] : top;
          }
        }
      }
      T total = 0;
      for (int64_t s = 0; s < slots; ++s) {
        const bool exact = kept_p[row * slots + s] && live_p[s];
        scores[s] = exact ? std::exp(scores[s] - top) : T(0);
        total += scores[s];
      }
      if (where != nullptr) {
        for (int64_t c = 0; c < cache.slots; ++c) {
          cached[c] = where[c] >= 0 && where[c] <= cache.limit ? std::exp(cached[c] - top) : T(0);
          total += cached[c];
        }
      }
      const T weight = (gamma_p != nullptr ? gamma_p[row] : T(1)) / total;
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
  Cache cache;
  cache.stays = stays.data_ptr<bool>();
  cache.rows = rows.data_ptr<int64_t>();
  cache.positions = positions.data_ptr<int64_t>();
  cache.keys = cached_keys.data_ptr();
  cache.values = cached_values.data_ptr();
  cache.weight = weight ? weight->data_ptr() : nullptr;
  cache.slots = positions.size(-1);
  cache.limit = limit;
  AT_DISPATCH_FLOATING_TYPES(memory.scalar_type(), "sparse_delta_token", [&] {
    token<scalar_t>(memory, qf, kf, log_decay, q, k, v, beta_new, keys, values, kept, live, betas, slot, gamma,
                    scale, out, cache);
  });
  return out;
}

// The Hedgehog map of one token per (b, h), unit-normalised (linattn.feature_maps.HedgehogFeatureMap.features,
// then linattn.features.unit_rows): z = W x + b, phi = [softmax(z), softmax(-z)]; keys phi e^{clamp(u.x)} + floor,
// queries phi + floor; then f / max(|f|, 1e-12). x (B, H, d); weight (H | 1, m, d), bias (H | 1, m), u (H | 1, d).
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
      const T* xr = x_p + row * dim;
      T* f = out_p + row * 2 * m;
      T top = -std::numeric_limits<T>::infinity(), bottom = std::numeric_limits<T>::infinity();
      for (int64_t i = 0; i < m; ++i) {
        z[i] = dot(w_p + (h * m + i) * dim, xr, dim) + b_p[h * m + i];
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
      if (u_p != nullptr) {  // a key: its learned weight e^{u.k}, u.k clipped to +-limit
        T logit = dot(u_p + h * dim, xr, dim);
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
template <typename T>
void gates(const at::Tensor& k, const at::Tensor& beta_w, const at::Tensor& beta_b, const at::Tensor& gate_w,
           const at::Tensor& gate_b, at::Tensor& beta, at::Tensor& log_gate) {
  const int64_t batch = k.size(0), kv_heads = k.size(1), dim = k.size(2), half = dim / 2;
  const int64_t heads = beta.size(1), group = heads / kv_heads;
  const T* k_p = k.data_ptr<T>();
  std::vector<T> u(half);
  for (int64_t row = 0; row < batch * kv_heads; ++row) {
    const int64_t h = row % kv_heads, b = row / kv_heads;
    const T* kr = k_p + row * dim;
    for (int64_t i = 0; i < half; ++i) u[i] = std::log1p(std::sqrt(kr[i] * kr[i] + kr[half + i] * kr[half + i] + T(1e-12)));
    const T strength = dot(u.data(), beta_w.data_ptr<T>() + h * half, half) + beta_b.data_ptr<T>()[h];
    const T logit = dot(u.data(), gate_w.data_ptr<T>() + h * half, half) + gate_b.data_ptr<T>()[h];
    const T s = T(1) / (T(1) + std::exp(-strength));
    const T g = std::min(logit, T(0)) - std::log1p(std::exp(-std::abs(logit)));
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("delta_window_token", &delta_window_token,
        "one decoding token of the window beside a delta-rule memory (see decode.cpp)");
  m.def("sparse_delta_token", &sparse_delta_token,
        "delta_window_token beside the sparse exact cache, between two boundaries (see decode.cpp)");
  m.def("hedgehog_unit_features", &hedgehog_unit_features, "the Hedgehog map's unit features of one token");
  m.def("key_gates", &key_gates, "beta and a per-head log-gate of one token from its keys (KeyGates)");
}

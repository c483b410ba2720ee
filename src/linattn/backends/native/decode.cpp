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

template <typename T>
void token(at::Tensor& memory, const at::Tensor& qf, const std::optional<at::Tensor>& kf,
           const std::optional<at::Tensor>& log_decay, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
           const at::Tensor& beta_new, at::Tensor& keys, at::Tensor& values, at::Tensor& kept, at::Tensor& live,
           at::Tensor& betas, int64_t slot, const std::optional<at::Tensor>& gamma, double scale, at::Tensor& out) {
  const int64_t batch = memory.size(0), heads = memory.size(1), features = memory.size(2), dv = memory.size(3);
  const int64_t dim = q.size(-1), slots = keys.size(2), kv_heads = k.size(1), group = heads / kv_heads;
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
    std::vector<T> recalled(dv), scores(slots), factor(features);
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
      const bool writes = kf_p != nullptr;
      const T strength = writes && kept_p[row * slots + slot] ? betas_p[row * slots + slot] : T(0);
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
      for (int64_t f = 0; f < features; ++f) {
        T* s = S + f * dv;
        const T qv = qrow[f];
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
      T total = 0;
      for (int64_t s = 0; s < slots; ++s) {
        const bool exact = kept_p[row * slots + s] && live_p[s];
        scores[s] = exact ? std::exp(scores[s] - top) : T(0);
        total += scores[s];
      }
      const T weight = (gamma_p != nullptr ? gamma_p[row] : T(1)) / total;
      for (int64_t s = 0; s < slots; ++s) {
        if (scores[s] == T(0)) continue;
        const T w = scores[s] * weight;
        const T* val = value_slots + s * dv;
#pragma omp simd
        for (int64_t j = 0; j < dv; ++j) o[j] += w * val[j];
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("delta_window_token", &delta_window_token,
        "one decoding token of the window beside a delta-rule memory (see decode.cpp)");
}

// A decoder layer's small operations on a CPU, each one pass over its rows
// (hetserve.runtime.kernels.native): writing a step's K/V into the pool, RMSNorm and rotary
// embedding. In plain torch each is 5-12 operators per layer; at decode sizes (tens of rows) the
// operators' fixed cost, not their arithmetic, is what a step pays.
//
// Each rounds where transformers' modeling_llama rounds, so a half-precision stage gives the
// numbers the torch operators give up to float32 summation order:
// - rms_norm: x in float32, x * rsqrt(mean(x^2) + eps) rounded to x's dtype, times the weight
//   (that product rounded again);
// - rotary: x * cos and rotate_half(x) * sin each rounded to x's dtype, then their sum.

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

// Row t of k and v to slot slot_mapping[t] of the caches (viewed as (slots, Hkv * D) rows); -1 skips.
void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "k and v (T, Hkv, D) of one shape");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "the caches must be contiguous and of one shape");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type(),
              "k, v and the caches must have one dtype");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0), "slot_mapping (T,)");
  const int64_t row = k.size(1) * k.size(2);
  TORCH_CHECK(k_cache.numel() % row == 0 && k_cache.size(-1) * k_cache.size(-2) == row,
              "the caches' rows must hold Hkv * D elements");
  const int64_t slots = k_cache.numel() / row, T = k.size(0);
  const at::Tensor kc = k.contiguous(), vc = v.contiguous();
  const at::Tensor map = slot_mapping.to(at::kLong).contiguous();
  const int64_t* s = map.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)  // every slot written lies in the pool: the copies below are unchecked
    TORCH_CHECK(s[t] >= -1 && s[t] < slots, "slot ", s[t], " of row ", t, " is outside the pool of ", slots, " slots");
  const int64_t bytes = row * k.element_size();
  const char* kp = static_cast<const char*>(kc.data_ptr());
  const char* vp = static_cast<const char*>(vc.data_ptr());
  char* kd = static_cast<char*>(k_cache.data_ptr());
  char* vd = static_cast<char*>(v_cache.data_ptr());
  at::parallel_for(0, T, 256, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      if (s[t] < 0) continue;
      std::memcpy(kd + s[t] * bytes, kp + t * bytes, bytes);
      std::memcpy(vd + s[t] * bytes, vp + t * bytes, bytes);
    }
  });
}

template <typename T>
inline T round_to(float x) {
  return static_cast<T>(x);
}

template <typename T>
void rms_rows(const T* x, const T* w, T* out, int64_t rows, int64_t H, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const T* xr = x + r * H;
      T* o = out + r * H;
      float sq = 0.f;
#pragma omp simd reduction(+ : sq)
      for (int64_t i = 0; i < H; ++i) sq += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
      const float inv = 1.f / std::sqrt(sq / static_cast<float>(H) + eps);
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) {
        const T normed = round_to<T>(static_cast<float>(xr[i]) * inv);
        o[i] = round_to<T>(static_cast<float>(w[i]) * static_cast<float>(normed));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1), "weight (H,) for x (..., H)");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must have one dtype");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t H = x.size(-1), rows = H ? xc.numel() / H : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_rows<scalar_t>(xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, H,
                       static_cast<float>(eps));
  });
  return out;
}

// out[t, h] = x[t, h] * cos[t] + rotate_half(x[t, h]) * sin[t], rotate_half(x) = (-x2, x1).
template <typename T>
void rotate_rows(const T* x, const T* cos, const T* sin, T* out, int64_t tokens, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  at::parallel_for(0, tokens, 8, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const T* c = cos + t * D;
      const T* s = sin + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + (t * heads + h) * D;
        T* o = out + (t * heads + h) * D;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          const float a = static_cast<float>(round_to<T>(static_cast<float>(xr[d]) * static_cast<float>(c[d])));
          const float b = static_cast<float>(round_to<T>(-static_cast<float>(xr[d + half]) * static_cast<float>(s[d])));
          o[d] = round_to<T>(a + b);
        }
#pragma omp simd
        for (int64_t d = half; d < D; ++d) {
          const float a = static_cast<float>(round_to<T>(static_cast<float>(xr[d]) * static_cast<float>(c[d])));
          const float b = static_cast<float>(round_to<T>(static_cast<float>(xr[d - half]) * static_cast<float>(s[d])));
          o[d] = round_to<T>(a + b);
        }
      }
    }
  });
}

at::Tensor rotate_one(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty_like(xc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    rotate_rows<scalar_t>(xc.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                          out.data_ptr<scalar_t>(), x.size(0), x.size(1), x.size(2));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                          const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "q (T, Hq, D) and k (T, Hkv, D)");
  TORCH_CHECK(q.size(2) % 2 == 0, "the head size must be even");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == q.size(0) && cos.size(1) == q.size(2),
              "cos and sin (T, D)");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && cos.scalar_type() == q.scalar_type() &&
                  sin.scalar_type() == q.scalar_type(), "q, k, cos and sin must have one dtype");
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  return {rotate_one(q, c, s), rotate_one(k, c, s)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hetserve_cpu, m) {
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hetserve_cpu, CPU, m) {
  m.impl("store_kv", &store_kv);
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
}

// Paged decode attention on a CPU, reading the KV pool in place (hetserve.runtime.kernels.native).
//
// One task per sequence: every query head scores every position of the sequence's context (slot =
// block_tables[b][p / block_size] * block_size + p % block_size) against its KV head's key (query
// head hq reads KV head hq / (Hq / Hkv)), takes a softmax and sums the values, all in float32; the
// output has q's dtype. A row of context 0 gives zeros and reads nothing. Same contract as
// kernels.paged_decode_attention.
//
// A position's keys of every KV head are one contiguous row of the pool, so a sequence streams
// through its blocks in order (the pool's layout, (blocks, block_size, Hkv, D), keeps a block's
// rows together); a task per (sequence, KV head) would stride over the other heads' rows and took
// 1.2-1.8x as long. Built at first use with -O3 -march=native: the loops over the head dimension
// are written for the compiler to vectorise (float32 rows are read in place, bfloat16 ones widen
// by a 16-bit shift); on a CPU with AVX512-BF16, bfloat16 scores use its dot-product instruction
// on the rows as stored (about 1.3x faster for bfloat16 pools on this machine's Xeon). Head sizes
// 64 and 128 are compiled with their size, so those loops unroll with no remainder to handle (a
// loop of a runtime 64 elements cost about as much again as its arithmetic), and the value pass
// widens a KV head's values once per position for its whole group of query heads: together
// 20-27 % off a bfloat16 layer and 3-23 % off a float32 one at the h512 / h1024 shapes.

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void widen<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
}

// ``n`` (= DC where DC > 0, so the loop has a compile-time count) elements as float32: float32
// rows are read where they lie, others widened into ``buf`` (where DC > 0, a local array: registers).
template <typename T, int DC = 0>
inline const float* widened(const T* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    widen<T>(src, buf, DC > 0 ? DC : n);
    return buf;
  }
}

// Whether this CPU's bfloat16 dot-product instruction scores rows of D elements: AVX512-BF16, D a
// multiple of 32 (each product is exact in float32).
inline bool has_bf16_dot(int64_t D) {
#if defined(__AVX512BF16__)
  return D % 32 == 0;
#else
  (void)D;
  return false;
#endif
}

// q . k over D bfloat16 elements in float32 by that instruction (call only where has_bf16_dot(D)).
template <int DC>
inline float bf16_dot(const c10::BFloat16* q, const c10::BFloat16* k, int64_t D) {
#if defined(__AVX512BF16__)
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < (DC > 0 ? DC : D); d += 32) {
    const __m512i a = _mm512_loadu_si512(reinterpret_cast<const void*>(q + d));
    const __m512i b = _mm512_loadu_si512(reinterpret_cast<const void*>(k + d));
    acc = _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
  }
  return _mm512_reduce_add_ps(acc);
#else
  (void)q; (void)k; (void)D;
  return 0.f;
#endif
}

template <typename T, int DC>
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& context_lens, float scale, at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = DC > 0 ? DC : q.size(2);
  const int64_t block = k_cache.size(1), Hkv = k_cache.size(2), G = Hq / Hkv;
  const int64_t width = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();

  const int64_t width_kv = Hkv * D;  // one position's keys (or values), every KV head: contiguous
  at::parallel_for(0, B, 1, [&](int64_t first, int64_t last) {
    std::vector<float> qf(Hq * D), acc(Hq * D), row(width_kv), total(Hq), scores;
    for (int64_t b = first; b < last; ++b) {
      const int64_t n = lens[b];
      T* o = op + b * Hq * D;
      if (n <= 0) {
        std::fill(o, o + Hq * D, T(0.0f));
        continue;
      }
      const int32_t* table = tables + b * width;
      scores.resize(Hq * n);
      bool fused = false;
      if constexpr (std::is_same_v<T, c10::BFloat16>) {  // scores[hq][p] = scale * q_hq . k_p, rows as stored
        fused = has_bf16_dot(D);
        for (int64_t p = 0; fused && p < n; ++p) {
          const int64_t slot = static_cast<int64_t>(table[p / block]) * block + p % block;
          const T* keys = kp + slot * width_kv;
          const T* queries = qp + b * Hq * D;
          for (int64_t hq = 0; hq < Hq; ++hq)
            scores[hq * n + p] = scale * bf16_dot<DC>(queries + hq * D, keys + (hq / G) * D, D);
        }
      }
      if (!fused) {  // the scaled queries in float32
        widen<T>(qp + b * Hq * D, qf.data(), Hq * D);
        for (int64_t i = 0; i < Hq * D; ++i) qf[i] *= scale;
      }
      for (int64_t p = 0; !fused && p < n; ++p) {  // scores[hq][p] = q_hq . k_p (of hq's KV head)
        const int64_t slot = static_cast<int64_t>(table[p / block]) * block + p % block;
        const float* keys = widened<T>(kp + slot * width_kv, row.data(), width_kv);
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const float* qh = qf.data() + hq * D;
          const float* kh = keys + (hq / G) * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qh[d] * kh[d];
          scores[hq * n + p] = s;
        }
      }
      for (int64_t hq = 0; hq < Hq; ++hq) {  // softmax numerators and their sum
        float* sh = scores.data() + hq * n;
        const float top = *std::max_element(sh, sh + n);
        float sum = 0.f;
        for (int64_t p = 0; p < n; ++p) {
          sh[p] = std::exp(sh[p] - top);
          sum += sh[p];
        }
        total[hq] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = 0; p < n; ++p) {  // acc[hq] += softmax[hq][p] * v_p, each KV head's values widened once
        const int64_t slot = static_cast<int64_t>(table[p / block]) * block + p % block;
        const T* row_v = vp + slot * width_kv;
        for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
          float vf_local[DC > 0 ? DC : 1];
          const float* vf = widened<T, DC>(row_v + kvh * D, DC > 0 ? vf_local : row.data(), D);
          for (int64_t g = 0; g < G; ++g) {
            const int64_t hq = kvh * G + g;
            const float w = scores[hq * n + p];
            float* a = acc.data() + hq * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += w * vf[d];
          }
        }
      }
      for (int64_t hq = 0; hq < Hq; ++hq) {
        const float inv = 1.f / total[hq];
        for (int64_t d = 0; d < D; ++d) o[hq * D + d] = T(acc[hq * D + d] * inv);
      }
    }
  });
}

template <typename T>
void attend_any(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& block_tables, const at::Tensor& context_lens, float scale, at::Tensor& out) {
  switch (q.size(2)) {  // the common head sizes compiled with their size: loops unrolled
    case 64: return attend<T, 64>(q, k_cache, v_cache, block_tables, context_lens, scale, out);
    case 128: return attend<T, 128>(q, k_cache, v_cache, block_tables, context_lens, scale, out);
    default: return attend<T, 0>(q, k_cache, v_cache, block_tables, context_lens, scale, out);
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q (B, Hq, D) and caches (num_blocks, block_size, Hkv, D) of one shape");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "q's head size must be the caches' and Hq a multiple of Hkv");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "q and the caches must have one dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && context_lens.numel() == q.size(0),
              "block_tables (B, max_blocks) and context_lens (B,)");
  at::Tensor qc = q.contiguous();
  at::Tensor tables = block_tables.to(at::kInt).contiguous();
  at::Tensor lens = context_lens.to(at::kInt).contiguous();
  // every block a context reads lies in the pool: the loops below read it unchecked
  const int64_t width = tables.size(1), block = k_cache.size(1), blocks = k_cache.size(0);
  const int32_t* t = tables.data_ptr<int32_t>();
  const int32_t* n = lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {
    const int64_t used = (static_cast<int64_t>(n[b]) + block - 1) / block;
    TORCH_CHECK(used <= width, "context ", n[b], " of row ", b, " needs ", used, " blocks; its table has ", width);
    for (int64_t i = 0; i < used; ++i)
      TORCH_CHECK(t[b * width + i] >= 0 && t[b * width + i] < blocks, "block ", t[b * width + i], " of row ", b,
                  " is outside the pool of ", blocks, " blocks");
  }
  at::Tensor out = at::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    attend_any<scalar_t>(qc, k_cache, v_cache, tables, lens, static_cast<float>(scale), out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(hetserve_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(hetserve_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }

// attnlab's own kernels for decoding a float32 batch on a CPU with AVX-512 (see attnlab/kernels.py).
//
// rows_linear: a few rows times a float32 weight streamed from memory, y (..., N) = x (..., K) @ W.T + b.
// Decoding a batch multiplies 2-8 rows by each weight once per step. oneDNN's and MKL's kernels (and a
// panel kernel like this one without the prefetch) read the weight at some 16.5 GB/s there, where a plain
// sum over it reads 22.5 (an Intel Xeon with AMX, 2 threads, SmolLM2's products at 8 rows): the FMAs of
// 8 rows keep the core too busy for the hardware prefetcher to run far enough ahead. This kernel reads
// the weight as one sequential stream per thread, in panels of 32 or 48 output columns laid out
// (K, 32 | 48) (see attnlab.kernels.pack_panels), and asks for the panel's lines 32 rows of k ahead:
// 21.7 GB/s on the same products.
//
// decode_attention: below.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kAhead = 32;  // rows of the panel (k) between a line's prefetch and its use

// y[m, p*16*NP + j] for the M rows of x: one panel (K, 16 * NP), M * NP accumulators held in registers.
template <int M, int NP>
void panel(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy, const float* bias) {
  __m512 acc[M][NP];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NP; ++j) acc[m][j] = bias ? _mm512_loadu_ps(bias + 16 * j) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* row = w + k * 16 * NP;
    __m512 wv[NP];
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) {
      wv[j] = _mm512_loadu_ps(row + 16 * j);
      _mm_prefetch(reinterpret_cast<const char*>(row + kAhead * 16 * NP + 16 * j), _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) acc[m][j] = _mm512_fmadd_ps(xb, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NP; ++j) _mm512_storeu_ps(y + m * ldy + 16 * j, acc[m][j]);
}

template <int NP>
void rows(int M, const float* x, const float* w, int64_t K, float* y, int64_t N, const float* bias) {
  using Fn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, const float*);
  static constexpr Fn fns[8] = {panel<1, NP>, panel<2, NP>, panel<3, NP>, panel<4, NP>,
                                panel<5, NP>, panel<6, NP>, panel<7, NP>, panel<8, NP>};
  const int64_t width = 16 * NP, panels = N / width;
  at::parallel_for(0, panels, 1, [&](int64_t a, int64_t b) {
    for (int64_t p = a; p < b; ++p)
      fns[M - 1](x, K, w + p * K * width, K, y + p * width, N, bias ? bias + p * width : nullptr);
  });
}

at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias) {
  // (TORCH_CHECK_TYPE / _VALUE: Python's TypeError / ValueError, naming the argument at fault)
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat && x.device().is_cpu(), "rows_linear: x must be a float32 CPU tensor, got ",
                   x.scalar_type(), " on ", x.device());
  TORCH_CHECK_TYPE(panels.scalar_type() == at::kFloat && panels.device().is_cpu(),
                   "rows_linear: panels must be a float32 CPU tensor, got ", panels.scalar_type(), " on ", panels.device());
  TORCH_CHECK_VALUE(panels.dim() == 3 && panels.is_contiguous() && (panels.size(2) == 32 || panels.size(2) == 48) &&
                        panels.size(1) > 0,
                    "rows_linear: panels must be pack_panels' (P, K, 32 | 48), contiguous, got shape ", panels.sizes());
  const int64_t K = panels.size(1), width = panels.size(2), N = panels.size(0) * width;
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) == K, "rows_linear: x must be (..., ", K,
                    ") for a weight of K = ", K, " features, got shape ", x.sizes());
  const at::Tensor xc = x.contiguous();
  auto shape = x.sizes().vec();
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  const float* b = nullptr;
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK_TYPE(bc.scalar_type() == at::kFloat && bc.device().is_cpu(), "rows_linear: bias must be a float32 CPU tensor, got ",
                     bc.scalar_type(), " on ", bc.device());
    TORCH_CHECK_VALUE(bc.dim() == 1 && bc.size(0) == N, "rows_linear: bias must be (", N, "), got shape ", bc.sizes());
    b = bc.data_ptr<float>();
  }
  const int64_t R = xc.numel() / K;
  for (int64_t r = 0; r < R; r += 8) {  // up to 8 rows a pass over the weight
    const int M = static_cast<int>(std::min<int64_t>(8, R - r));
    const float* xr = xc.data_ptr<float>() + r * K;
    float* yr = y.data_ptr<float>() + r * N;
    if (width == 48)
      rows<3>(M, xr, panels.data_ptr<float>(), K, yr, N, b);
    else
      rows<2>(M, xr, panels.data_ptr<float>(), K, yr, N, b);
  }
  return y;
}

// One new query per row against the filled slots 0..slot of a preallocated float32 cache:
// softmax(q k^T * scale) v. q (B, Hkv, G, hd): the G query heads that share each key head; keys, values
// (B, Hkv, M, hd). The compiled decoding step of a batch attends over all M slots with a mask in
// inductor's loops (SmolLM2's batch of 8: 94 MB of cache a step over 256 slots, 7 ms of 37); this reads
// only the filled ones, each key and value row once for its G queries.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& slot, double scale) {
  for (const at::Tensor* t : {&q, &keys, &values})
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat && t->device().is_cpu(),
                     "decode_attention: q, keys and values must be float32 CPU tensors, got ", t->scalar_type(), " on ",
                     t->device());
  TORCH_CHECK_VALUE(q.dim() == 4 && keys.dim() == 4 && keys.sizes() == values.sizes() && keys.size(0) == q.size(0) &&
                        keys.size(1) == q.size(1) && keys.size(3) == q.size(3) && keys.is_contiguous() &&
                        values.is_contiguous(),
                    "decode_attention: q must be (B, Hkv, G, hd), keys and values contiguous (B, Hkv, M, hd), got ",
                    q.sizes(), ", ", keys.sizes(), ", ", values.sizes());
  TORCH_CHECK_VALUE(slot.numel() == 1 && slot.scalar_type() == at::kLong, "decode_attention: slot must be one int64");
  const int64_t B = q.size(0), Hkv = q.size(1), G = q.size(2), hd = q.size(3), M = keys.size(2);
  const int64_t S = slot.item<int64_t>() + 1;
  TORCH_CHECK_VALUE(S >= 1 && S <= M, "decode_attention: slot must be in [0, ", M, "), got ", S - 1);
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty_like(qc);
  const float *qp = qc.data_ptr<float>(), *kp = keys.data_ptr<float>(), *vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t a, int64_t b) {
    std::vector<float> e(G * S), total(G);
    for (int64_t bh = a; bh < b; ++bh) {
      const float *k = kp + bh * M * hd, *v = vp + bh * M * hd, *qq = qp + bh * G * hd;
      float* o = op + bh * G * hd;
      for (int64_t m = 0; m < S; ++m) {  // scores: each key row read once for the G queries
        const float* kr = k + m * hd;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qq + g * hd;
          float d = 0.f;
#pragma omp simd reduction(+ : d)
          for (int64_t i = 0; i < hd; ++i) d += qg[i] * kr[i];
          e[g * S + m] = d * sc;
        }
      }
      for (int64_t g = 0; g < G; ++g) {  // softmax's exponentials, their sum divided at the end
        float* eg = e.data() + g * S;
        float mx = eg[0];
        for (int64_t m = 1; m < S; ++m) mx = std::max(mx, eg[m]);
        // (ATen's vectorised exp_u20, as its CPU flash attention takes its softmax's exponentials)
        using Vec = at::vec::Vectorized<float>;
        for (int64_t m = 0; m < S; m += Vec::size()) {
          const int n = static_cast<int>(std::min<int64_t>(Vec::size(), S - m));
          (Vec::loadu(eg + m, n) - Vec(mx)).exp_u20().store(eg + m, n);
        }
        float sum = 0.f;
        for (int64_t m = 0; m < S; ++m) sum += eg[m];
        total[g] = sum;
      }
      std::fill(o, o + G * hd, 0.f);
      for (int64_t m = 0; m < S; ++m) {  // each value row read once for the G queries
        const float* vr = v + m * hd;
        for (int64_t g = 0; g < G; ++g) {
          const float w = e[g * S + m];
          float* og = o + g * hd;
#pragma omp simd
          for (int64_t i = 0; i < hd; ++i) og[i] += w * vr[i];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < hd; ++i) o[g * hd + i] /= total[g];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(attnlab_kernels, m) {
  m.def("rows_linear(Tensor x, Tensor panels, Tensor? bias) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor keys, Tensor values, Tensor slot, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnlab_kernels, CPU, m) {
  m.impl("rows_linear", rows_linear);
  m.impl("decode_attention", decode_attention);
}

// The floor of a decoding step's weight reads on the CPU, for benchmarks/decode_breakdown.py --cxx:
// every matrix-vector product of a step (float32, one row) in ONE OpenMP parallel region, each
// matrix's rows split over the threads, a single barrier after each matrix (a step compiled by
// inductor has about 20 per layer). No attention, norms or RoPE: only the weight reads.
#include <torch/extension.h>
#include <omp.h>

#include <vector>

// y = W @ x for each W of `weights` (N, K) in turn (x: the first K entries of `x`); the products are
// not chained (each reads the same x): the time is the reads'. Four rows at once, so that each
// load of x serves four weight streams.
void chain(const std::vector<torch::Tensor>& weights, const torch::Tensor& x, torch::Tensor& out, int64_t threads) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && out.dtype() == torch::kFloat32, "float32 only");
  for (const auto& w : weights) {
    TORCH_CHECK(w.dtype() == torch::kFloat32 && w.is_contiguous() && w.dim() == 2, "contiguous float32 matrices");
    TORCH_CHECK(w.size(1) <= x.numel() && w.size(0) <= out.numel(), "x or out too short for a matrix");
  }
  const float* xp = x.data_ptr<float>();
  float* yp = out.data_ptr<float>();
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    for (const auto& w : weights) {
      const float* W = w.data_ptr<float>();
      const int64_t N = w.size(0), K = w.size(1);
      const int64_t hi = N * (t + 1) / nt;
      int64_t r = N * t / nt;
      for (; r + 4 <= hi; r += 4) {
        const float *a = W + r * K, *b = a + K, *c = b + K, *d = c + K;
        float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int64_t k = 0; k < K; ++k) {
          const float v = xp[k];
          s0 += a[k] * v, s1 += b[k] * v, s2 += c[k] * v, s3 += d[k] * v;
        }
        yp[r] = s0, yp[r + 1] = s1, yp[r + 2] = s2, yp[r + 3] = s3;
      }
      for (; r < hi; ++r) {
        const float* a = W + r * K;
        float s = 0;
#pragma omp simd reduction(+ : s)
        for (int64_t k = 0; k < K; ++k) s += a[k] * xp[k];
        yp[r] = s;
      }
#pragma omp barrier
    }
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("chain", &chain, "every matrix-vector product of a step, one region"); }

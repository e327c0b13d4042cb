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
// decode_attention: below. bf16_linear: a bfloat16 row times a bfloat16 weight (below). block_linear and
// pack_blocks: a GGUF file's blocks (below). block_layer: a whole Llama-style block on its blocks (at the end).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kAhead = 32;  // rows of the panel (k) between a line's prefetch and its use

// acc[m][j] += x[m, k] * wv[j] for the M rows of x and NP vectors of 16 output columns (each accumulator
// takes the k in order: the kernels below sum alike).
template <int M, int NP>
__attribute__((always_inline)) inline void fma_rows(__m512 (&acc)[M][NP], const float* x, int64_t ldx, int64_t k,
                                                    const __m512* wv) {
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
    const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) acc[m][j] = _mm512_fmadd_ps(xb, wv[j], acc[m][j]);
  }
}

template <int M, int NP>
__attribute__((always_inline)) inline void init_rows(__m512 (&acc)[M][NP], const float* bias) {
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NP; ++j) acc[m][j] = bias ? _mm512_loadu_ps(bias + 16 * j) : _mm512_setzero_ps();
}

template <int M, int NP>
__attribute__((always_inline)) inline void store_rows(const __m512 (&acc)[M][NP], float* y, int64_t ldy) {
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NP; ++j) _mm512_storeu_ps(y + m * ldy + 16 * j, acc[m][j]);
}

// 16 values at p as float32s: float32, or bfloat16 (its bits the float32's high half): a panel's weights,
// a cache's keys and values.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// y[m, p*16*NP + j] for the M rows of x: one panel (K, 16 * NP) of T (float32, or bfloat16 widened
// exactly: the screened head's), M * NP accumulators held in registers.
template <int M, int NP, typename T>
void panel(const float* x, int64_t ldx, const T* w, int64_t K, float* y, int64_t ldy, const float* bias) {
  __m512 acc[M][NP];
  init_rows<M, NP>(acc, bias);
  for (int64_t k = 0; k < K; ++k) {
    const T* row = w + k * 16 * NP;
    __m512 wv[NP];
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) {
      wv[j] = load16(row + 16 * j);
      _mm_prefetch(reinterpret_cast<const char*>(row + kAhead * 16 * NP + 16 * j), _MM_HINT_T0);
    }
    fma_rows<M, NP>(acc, x, ldx, k, wv);
  }
  store_rows<M, NP>(acc, y, ldy);
}

template <int NP, typename T>
void rows(int M, const float* x, const T* w, int64_t K, float* y, int64_t N, const float* bias) {
  using Fn = void (*)(const float*, int64_t, const T*, int64_t, float*, int64_t, const float*);
  static constexpr Fn fns[8] = {panel<1, NP, T>, panel<2, NP, T>, panel<3, NP, T>, panel<4, NP, T>,
                                panel<5, NP, T>, panel<6, NP, T>, panel<7, NP, T>, panel<8, NP, T>};
  const int64_t width = 16 * NP, panels = N / width;
  at::parallel_for(0, panels, 1, [&](int64_t a, int64_t b) {
    for (int64_t p = a; p < b; ++p)
      fns[M - 1](x, K, w + p * K * width, K, y + p * width, N, bias ? bias + p * width : nullptr);
  });
}

// The part rows_linear, block_linear and bf16_linear share: checks x (..., K) and bias (N), float32 or (a
// bfloat16 x) bfloat16 (`op` names the caller in the errors), makes y (..., N) of x's dtype, and calls
// pass(M, x rows, y rows, bias) for each pass of up to 8 rows, in float32: a bfloat16 x and bias widened
// first, y's sums rounded once to bfloat16 after (to the nearest even).
template <typename Pass>
at::Tensor by_passes(const char* op, const at::Tensor& x, int64_t K, int64_t N, const std::optional<at::Tensor>& bias,
                     Pass pass) {
  // (TORCH_CHECK_TYPE / _VALUE: Python's TypeError / ValueError, naming the argument at fault)
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) == K, op, ": x must be (..., ", K, ") for a weight of K = ", K,
                    " features, got shape ", x.sizes());
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const at::Tensor xc = x.contiguous();
  const int64_t R = xc.numel() / K;
  auto shape = x.sizes().vec();
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());
  std::vector<float> xf, yf, bf;  // (a bfloat16 x's rows, y's sums and the bias, in float32)
  if (bf16) {
    xf.assign(xc.data_ptr<at::BFloat16>(), xc.data_ptr<at::BFloat16>() + R * K);
    yf.resize(R * N);
  }
  const float* b = nullptr;
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK_TYPE(bc.scalar_type() == x.scalar_type() && bc.device().is_cpu(), op, ": bias must be a ",
                     bf16 ? "bfloat16" : "float32", " CPU tensor, got ", bc.scalar_type(), " on ", bc.device());
    TORCH_CHECK_VALUE(bc.dim() == 1 && bc.size(0) == N, op, ": bias must be (", N, "), got shape ", bc.sizes());
    if (bf16) bf.assign(bc.data_ptr<at::BFloat16>(), bc.data_ptr<at::BFloat16>() + N);
    b = bf16 ? bf.data() : bc.data_ptr<float>();
  }
  const float* xs = bf16 ? xf.data() : xc.data_ptr<float>();
  float* ys = bf16 ? yf.data() : y.data_ptr<float>();
  for (int64_t r = 0; r < R; r += 8) {  // up to 8 rows a pass over the weight
    const int M = static_cast<int>(std::min<int64_t>(8, R - r));
    pass(M, xs + r * K, ys + r * N, b);
  }
  if (bf16) {
    at::BFloat16* yp = y.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < R * N; ++i) yp[i] = at::BFloat16(yf[i]);
  }
  return y;
}

// (bfloat16 panels: the screened head's, attnlab.decoding.ScreenedHead; the sums float32, y float32)
at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat && x.device().is_cpu(), "rows_linear: x must be a float32 CPU tensor, got ",
                   x.scalar_type(), " on ", x.device());
  const bool bf16 = panels.scalar_type() == at::kBFloat16;
  TORCH_CHECK_TYPE((panels.scalar_type() == at::kFloat || bf16) && panels.device().is_cpu(),
                   "rows_linear: panels must be a float32 or bfloat16 CPU tensor, got ", panels.scalar_type(), " on ",
                   panels.device());
  TORCH_CHECK_VALUE(panels.dim() == 3 && panels.is_contiguous() && (panels.size(2) == 32 || panels.size(2) == 48) &&
                        panels.size(1) > 0,
                    "rows_linear: panels must be pack_panels' (P, K, 32 | 48), contiguous, got shape ", panels.sizes());
  const int64_t K = panels.size(1), width = panels.size(2), N = panels.size(0) * width;
  auto product = [&](const auto* w) {  // (w: the panels' float32 or bfloat16 values)
    return by_passes("rows_linear", x, K, N, bias, [&](int M, const float* xr, float* yr, const float* b) {
      width == 48 ? rows<3>(M, xr, w, K, yr, N, b) : rows<2>(M, xr, w, K, yr, N, b);
    });
  };
  return bf16 ? product(panels.data_ptr<at::BFloat16>()) : product(panels.data_ptr<float>());
}

// ---------------------------------------------------------------------------------------------------
// bf16_linear: a few rows times a bfloat16 weight in its own (N, K) layout, for decoding a bfloat16 model.
// Each output is a dot product along k: w's rows 8 at a time (one contiguous stretch of 8 K bfloat16s),
// each read once, in order, for all the rows of x. A pair of bfloat16 weights is one 32-bit lane, the
// odd k its high half (a float32 once the low half is cleared), the even k its low half (shifted up), so
// x's even and odd k are multiplied apart: float32 products and sums, rounded once to bfloat16 (with the
// bias), as inductor's sums in the compiled step, in another order. No packed copy: the weight is read
// where it lies.
// ---------------------------------------------------------------------------------------------------
constexpr int64_t kBf16Ahead = 1;  // w's rows prefetched this many stretches of 8 ahead

// x's 32 k at p as their 16 even k (ev) and their 16 odd k (ov): the halves a bfloat16 pair's lanes meet.
inline void even_odd(const float* p, __m512& ev, __m512& ov) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512 lo = _mm512_loadu_ps(p), hi = _mm512_loadu_ps(p + 16);
  ev = _mm512_permutex2var_ps(lo, even, hi), ov = _mm512_permutex2var_ps(lo, odd, hi);
}

// out[r] = w's row r . x for one row x (float32, K): 8 rows of w at a time, x's even and odd k split in
// registers once for all of them.
template <int R>
void bf16_dots(const uint16_t* w, int64_t K, const float* x, float* out) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512 ev, ov;
    even_odd(x + k, ev, ov);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i v = _mm512_loadu_si512(w + r * K + k);
      _mm_prefetch(reinterpret_cast<const char*>(w + (kBf16Ahead * R + r) * K + k), _MM_HINT_T0);
      acc[r] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), ev, acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v, high)), ov, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

// out[m * 8 + r] = w's rows r0 .. r0 + RN - 1 (RN = 1 | 2) . x's M rows, x given split (xs: each row's
// 32 k a step as 16 even k then 16 odd k): each weight loaded and widened once for all M rows, the sums
// of each (m, r) those of bf16_dots, in the same order.
template <int M, int RN>
void bf16_pair(const uint16_t* w, int64_t K, int R, int r0, const float* xs, float* out) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 acc[M][RN];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < RN; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512 we[RN], wo[RN];
    for (int j = 0; j < RN; ++j) {
      const __m512i v = _mm512_loadu_si512(w + (r0 + j) * K + k);
      _mm_prefetch(reinterpret_cast<const char*>(w + (kBf16Ahead * R + r0 + j) * K + k), _MM_HINT_T0);
      we[j] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      wo[j] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512 ev = _mm512_loadu_ps(xs + m * K + k), ov = _mm512_loadu_ps(xs + m * K + k + 16);
      for (int j = 0; j < RN; ++j) acc[m][j] = _mm512_fmadd_ps(wo[j], ov, _mm512_fmadd_ps(we[j], ev, acc[m][j]));
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < RN; ++j) out[m * 8 + r0 + j] = _mm512_reduce_add_ps(acc[m][j]);
}

// bf16_pair over the R rows of a stretch, two at a time.
template <int M>
void bf16_stretch(const uint16_t* w, int64_t K, int R, const float* xs, float* out) {
  int r = 0;
  for (; r + 2 <= R; r += 2) bf16_pair<M, 2>(w, K, R, r, xs, out);
  if (r < R) bf16_pair<M, 1>(w, K, R, r, xs, out);
}

// y (M rows of N, a row every ldy) = x (M rows of K) times w's rows 8 g .. for the stretches g0 .. g1 - 1,
// float32 (bias: none, or N float32s). One row: bf16_dots on each stretch; more: x split once (even and
// odd k apart, M K floats), then bf16_stretch, which reads each weight once for them all (a batch of 8
// of SmolLM2's 121 products, 35.6 -> 27.6 ms, the same bits; Intel Xeon, 2 threads, alternating in one
// process).
void bf16_range(const uint16_t* w, int64_t N, int64_t K, int M, const float* x, int64_t g0, int64_t g1, float* y,
                int64_t ldy, const float* bias) {
  using Dots = void (*)(const uint16_t*, int64_t, const float*, float*);
  static constexpr Dots dots[8] = {bf16_dots<1>, bf16_dots<2>, bf16_dots<3>, bf16_dots<4>,
                                   bf16_dots<5>, bf16_dots<6>, bf16_dots<7>, bf16_dots<8>};
  using Stretch = void (*)(const uint16_t*, int64_t, int, const float*, float*);
  static constexpr Stretch stretches[8] = {bf16_stretch<1>, bf16_stretch<2>, bf16_stretch<3>, bf16_stretch<4>,
                                           bf16_stretch<5>, bf16_stretch<6>, bf16_stretch<7>, bf16_stretch<8>};
  std::vector<float> xs;
  if (M > 1) {
    xs.resize(M * K);
    for (int64_t i = 0; i < M * K; i += 32) {
      __m512 ev, ov;
      even_odd(x + i, ev, ov);
      _mm512_storeu_ps(xs.data() + i, ev);
      _mm512_storeu_ps(xs.data() + i + 16, ov);
    }
  }
  float out[64];
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t n0 = 8 * g;
    const int rows = static_cast<int>(std::min<int64_t>(8, N - n0));
    if (M == 1)
      dots[rows - 1](w + n0 * K, K, x, out);
    else
      stretches[M - 1](w + n0 * K, K, rows, xs.data(), out);
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < rows; ++r) y[m * ldy + n0 + r] = out[m * 8 + r] + (bias ? bias[n0 + r] : 0.f);
  }
}

// A bfloat16 weight's checks (argument `name` of operator `op`): a contiguous (N, K), K a multiple of 32.
void check_bf16_weight(const at::Tensor& weight, const char* op, const char* name) {
  TORCH_CHECK_TYPE(weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(), op, ": ", name,
                   " must be a bfloat16 CPU tensor, got ", weight.scalar_type(), " on ", weight.device());
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) % 32 == 0 && weight.size(1) > 0, op,
                    ": ", name, " must be a contiguous (N, K) matrix, K a multiple of 32, got shape ", weight.sizes());
}

// ---------------------------------------------------------------------------------------------------
// amx_range: bf16_range's product by AMX's tiles (Intel Xeons from Sapphire Rapids on), for a batch of a
// bfloat16 model: the weight copied once a generation into tiles of 32 k x 16 columns, each k pair a lane
// (pack_amx's (N / 16, K / 32, 16, 16, 2)); a tile of x's M rows times three such tiles a step. Each row's
// sums float32 in the tiles' own order (a pair of products, then the running sum), whatever the rows
// beside it; inputs and results below 2^-126 flushed to zero, as AMX does. 8 rows widened and multiplied in
// FMAs are arithmetic: SmolLM2's 120 products at 8 rows took 27.4-28.4 ms by bf16_range, 15.6-16.5 by
// tiles (a probe, 2 threads, Intel Xeon). The caller holds the tiles' permission (torch's init_amx).
// ---------------------------------------------------------------------------------------------------
struct TileConfig {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// The M rows of x (K floats each, bfloat16 values) times the packed weight's groups g0..g1 - 1 of 48
// output columns (three tiles of 16) into y (M rows of ldy floats).
__attribute__((target("amx-tile,amx-bf16"))) void amx_range(const uint16_t* w, int64_t K, int M, const float* x,
                                                               int64_t g0, int64_t g1, float* y, int64_t ldy) {
  std::vector<at::BFloat16> xb(x, x + M * K);  // (exact: the caller's values are bfloat16's)
  TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 4; ++t) cfg.colsb[t] = 64, cfg.rows[t] = static_cast<uint8_t>(M);  // C0-C2 (M x 16), A (M x 32)
  for (int t = 4; t < 7; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;                        // B0-B2 (16 k pairs x 16)
  _tile_loadconfig(&cfg);
  const int64_t KC = K / 32, tile = 512;  // (a weight tile: 16 x 16 x 2 bfloat16s)
  for (int64_t g = g0; g < g1; ++g) {
    const uint16_t* w0 = w + 3 * g * KC * tile;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int64_t c = 0; c < KC; ++c) {
      _tile_loadd(3, xb.data() + 32 * c, K * 2);
      _tile_loadd(4, w0 + c * tile, 64);
      _tile_loadd(5, w0 + (KC + c) * tile, 64);
      _tile_loadd(6, w0 + (2 * KC + c) * tile, 64);
      _tile_dpbf16ps(0, 3, 4);
      _tile_dpbf16ps(1, 3, 5);
      _tile_dpbf16ps(2, 3, 6);
    }
    _tile_stored(0, y + 48 * g, ldy * 4);
    _tile_stored(1, y + 48 * g + 16, ldy * 4);
    _tile_stored(2, y + 48 * g + 32, ldy * 4);
  }
  _tile_release();
}

// Whether this CPU has AMX's bfloat16 tiles and this process may use them (torch's init_amx asks the
// kernel once: Linux grants the tiles' state per process). Without, a tile instruction would kill it.
bool amx_available() {
  static const bool ok = at::cpu::init_amx();
  return ok;
}

// A weight pack_amx made (`op` and `name` in the errors): TypeError or ValueError where it is not, and a
// RuntimeError where the CPU has no tiles.
void check_amx_weight(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kBFloat16 && t.device().is_cpu() && t.dim() == 5 && t.is_contiguous() &&
                        t.size(0) % 3 == 0 && t.size(2) == 16 && t.size(3) == 16 && t.size(4) == 2,
                    op, ": ", name, " must be pack_amx's (N / 16, K / 32, 16, 16, 2) bfloat16 on the CPU, got ",
                    t.scalar_type(), " ", t.sizes());
  TORCH_CHECK(amx_available(), op, ": ", name, " is packed for AMX's tiles, which this CPU or process cannot use");
}

// pack_amx: a bfloat16 weight (N, K), N a multiple of 48 and K of 32, as amx_range reads it.
at::Tensor pack_amx(const at::Tensor& weight) {
  check_bf16_weight(weight, "pack_amx", "weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK_VALUE(N % 48 == 0, "pack_amx: weight must have a multiple of 48 rows, got shape ", weight.sizes());
  return weight.view({N / 16, 16, K / 32, 16, 2}).permute({0, 2, 3, 1, 4}).contiguous();
}

// bf16_linear: x's rows times a bfloat16 weight as it lies (bf16_range), or pack_amx's (amx_range).
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const bool amx = weight.dim() == 5;
  amx ? check_amx_weight(weight, "bf16_linear", "weight") : check_bf16_weight(weight, "bf16_linear", "weight");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kBFloat16 && x.device().is_cpu(), "bf16_linear: x must be a bfloat16 CPU tensor, got ",
                   x.scalar_type(), " on ", x.device());
  const int64_t N = weight.size(0) * (amx ? 16 : 1), K = weight.size(1) * (amx ? 32 : 1);
  const uint16_t* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  return by_passes("bf16_linear", x, K, N, bias, [&](int M, const float* xr, float* yr, const float* b) {
    if (!amx)
      return at::parallel_for(0, (N + 7) / 8, 1, [&](int64_t a, int64_t c) { bf16_range(w, N, K, M, xr, a, c, yr, N, b); });
    at::parallel_for(0, N / 48, 1, [&](int64_t a, int64_t c) { amx_range(w, K, M, xr, a, c, yr, N); });
    for (int m = 0; m < M && b != nullptr; ++m)  // (the tiles' sums, then the bias)
      for (int64_t j = 0; j < N; ++j) yr[m * N + j] += b[j];
  });
}

// The position `slot` names (one int64) in a cache of M slots, checked: ValueError naming `op`'s argument.
int64_t slot_of(const at::Tensor& slot, int64_t M, const char* op) {
  TORCH_CHECK_VALUE(slot.numel() == 1 && slot.scalar_type() == at::kLong, op, ": slot must be one int64");
  const int64_t pos = slot.item<int64_t>();
  TORCH_CHECK_VALUE(pos >= 0 && pos < M, op, ": slot must be in [0, ", M, "), got ", pos);
  return pos;
}

// attend_group prefetches each key row this many rows ahead of its use, and the value row of the same
// slot into L2 for the sums after the scores: GPT-2-small's 12 layers at 8 rows over 41, 101 and 151
// filled slots read their caches at 12.1-16.2 GB/s against 10.0-11.9 without (Intel Xeon, 2 threads,
// alternating processes; 16 rows ahead was no better, a prefetch of the next head's first rows worse).
constexpr int64_t kAttAhead = 8;

// Queries g0..g1 of the G that share key head bh (of the B * Hkv) against its filled slots 0..S-1:
// q (B * Hkv, G, hd), keys and values (B * Hkv, M, hd) (T: float32 or bfloat16; the sums float32),
// their outputs to o (as q), and with wp their softmax's weights to wp (B * Hkv, G, wlen), wlen >= S
// (the slots past S untouched); e: (g1 - g0) * S floats of scratch.
template <typename T>
void attend_group(const float* qp, const T* kp, const T* vp, float* op, float* wp, int64_t bh, int64_t g0, int64_t g1,
                  int64_t G, int64_t S, int64_t M, int64_t hd, float sc, float* e, int64_t wlen) {
  const bool wide = hd > 0 && hd % 16 == 0;  // (the heads of every model attnlab reads: 64, 128, ...)
  const T *k = kp + bh * M * hd, *v = vp + bh * M * hd;
  const float* qq = qp + bh * G * hd;
  float* o = op + bh * G * hd;
  const int64_t n = g1 - g0;
  const int64_t row_bytes = hd * static_cast<int64_t>(sizeof(T));
  for (int64_t m = 0; m < S && wide; ++m) {  // (hd a multiple of 16: the same, a vector of 16 at a time)
    const T* kr = k + m * hd;
    for (int64_t l = 0; l < row_bytes; l += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(kr + kAttAhead * hd) + l, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(v + m * hd) + l, _MM_HINT_T1);
    }
    for (int64_t g = g0; g < g1; ++g) {
      const float* qg = qq + g * hd;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), load16(kr));
      for (int64_t i = 16; i < hd; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + i), load16(kr + i), acc);
      e[(g - g0) * S + m] = _mm512_reduce_add_ps(acc) * sc;
    }
  }
  for (int64_t m = 0; m < S && !wide; ++m) {  // scores: each key row read once for the queries
    const T* kr = k + m * hd;
    for (int64_t g = g0; g < g1; ++g) {
      const float* qg = qq + g * hd;
      float d = 0.f;
#pragma omp simd reduction(+ : d)
      for (int64_t i = 0; i < hd; ++i) d += qg[i] * static_cast<float>(kr[i]);
      e[(g - g0) * S + m] = d * sc;
    }
  }
  std::vector<float> total(n);
  for (int64_t j = 0; j < n; ++j) {  // softmax's exponentials, their sum divided at the end
    float* eg = e + j * S;
    float mx = eg[0];
    for (int64_t m = 1; m < S; ++m) mx = std::max(mx, eg[m]);
    // (ATen's vectorised exp_u20, as its CPU flash attention takes its softmax's exponentials)
    using Vec = at::vec::Vectorized<float>;
    for (int64_t m = 0; m < S; m += Vec::size()) {
      const int c = static_cast<int>(std::min<int64_t>(Vec::size(), S - m));
      (Vec::loadu(eg + m, c) - Vec(mx)).exp_u20().store(eg + m, c);
    }
    float sum = 0.f;
    for (int64_t m = 0; m < S; ++m) sum += eg[m];
    total[j] = sum;
  }
  std::fill(o + g0 * hd, o + g1 * hd, 0.f);
  for (int64_t g = g0; g < g1 && wide; ++g)  // (hd a multiple of 16: a query's sums in registers, 64 at a time)
    for (int64_t i = 0; i < hd; i += 64) {
      const int c4 = static_cast<int>(std::min<int64_t>(4, (hd - i) / 16));
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      const float* eg = e + (g - g0) * S;
      for (int64_t m = 0; m < S; ++m) {
        const __m512 w = _mm512_set1_ps(eg[m]);
        const T* vr = v + m * hd + i;
        for (int c = 0; c < c4; ++c) acc[c] = _mm512_fmadd_ps(w, load16(vr + 16 * c), acc[c]);
      }
      for (int c = 0; c < c4; ++c) _mm512_storeu_ps(o + g * hd + i + 16 * c, acc[c]);
    }
  for (int64_t m = 0; m < S && !wide; ++m) {  // each value row read once for the queries
    const T* vr = v + m * hd;
    for (int64_t g = g0; g < g1; ++g) {
      const float w = e[(g - g0) * S + m];
      float* og = o + g * hd;
#pragma omp simd
      for (int64_t i = 0; i < hd; ++i) og[i] += w * static_cast<float>(vr[i]);
    }
  }
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t i = 0; i < hd; ++i) o[g * hd + i] /= total[g - g0];
  for (int64_t g = g0; g < g1 && wp != nullptr; ++g)
    for (int64_t m = 0; m < S; ++m) wp[(bh * G + g) * wlen + m] = e[(g - g0) * S + m] / total[g - g0];
}

// One new query per row against the filled slots 0..slot of a preallocated float32 cache:
// softmax(q k^T * scale) v. q (B, Hkv, G, hd): the G query heads that share each key head; keys, values
// (B, Hkv, M, hd). The compiled decoding step of a batch attends over all M slots with a mask in
// inductor's loops (SmolLM2's batch of 8: 94 MB of cache a step over 256 slots, 7 ms of 37); this reads
// only the filled ones, each key and value row once for its G queries.
// With `weights` ((B, Hkv, G, M) float32, or null): the softmax's weights there too, 0 at the empty slots.
at::Tensor attend_filled(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& slot,
                         double scale, at::Tensor* weights) {
  for (const at::Tensor* t : {&q, &keys, &values})
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat && t->device().is_cpu(),
                     "decode_attention: q, keys and values must be float32 CPU tensors, got ", t->scalar_type(), " on ",
                     t->device());
  TORCH_CHECK_VALUE(q.dim() == 4 && keys.dim() == 4 && keys.sizes() == values.sizes() && keys.size(0) == q.size(0) &&
                        keys.size(1) == q.size(1) && keys.size(3) == q.size(3) && keys.is_contiguous() &&
                        values.is_contiguous(),
                    "decode_attention: q must be (B, Hkv, G, hd), keys and values contiguous (B, Hkv, M, hd), got ",
                    q.sizes(), ", ", keys.sizes(), ", ", values.sizes());
  const int64_t B = q.size(0), Hkv = q.size(1), G = q.size(2), hd = q.size(3), M = keys.size(2);
  const int64_t S = slot_of(slot, M, "decode_attention") + 1;
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty_like(qc);
  const float *qp = qc.data_ptr<float>(), *kp = keys.data_ptr<float>(), *vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* wp = nullptr;
  if (weights != nullptr) {
    *weights = at::zeros({B, Hkv, G, M}, qc.options());
    wp = weights->data_ptr<float>();
  }
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t a, int64_t b) {
    std::vector<float> e(G * S);
    for (int64_t bh = a; bh < b; ++bh) attend_group(qp, kp, vp, op, wp, bh, 0, G, G, S, M, hd, sc, e.data(), M);
  });
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& slot,
                            double scale) {
  return attend_filled(q, keys, values, slot, scale, nullptr);
}

// decode_attention, and its weights over all M slots (B, Hkv, G, M), 0 at the empty ones: what an observer
// of the step reads (serve's generation stream shows each token's attention).
std::tuple<at::Tensor, at::Tensor> decode_attention_weights(const at::Tensor& q, const at::Tensor& keys,
                                                            const at::Tensor& values, const at::Tensor& slot,
                                                            double scale) {
  at::Tensor weights;
  at::Tensor out = attend_filled(q, keys, values, slot, scale, &weights);
  return {out, weights};
}


// ---------------------------------------------------------------------------------------------------
// block_linear: rows_linear on a weight kept in the blocks a GGUF file quantized it in, Q4_1 or Q8_0.
//
// A GGUF model loaded in float32 holds each weight dequantized: Q4_1's w = d * q + m (q 4 bits, d and m
// float16, one pair per 32 weights of a row), Q8_0's w = d * q (q 8 bits). Those float32 values are
// exactly d * q + m rounded once, what a fused multiply-add gives: pack_blocks finds d, m and q back
// from the float32 weight, block by block, and keeps them only if every weight comes back bit for bit
// (else the weight stays float32). The kernel then reads 5 bits a weight (Q4_1) or 8.5 (Q8_0) instead
// of 32, rebuilds each float32 weight in a register with one FMA, and multiplies it as rows_linear does,
// in the same order: the same sums, bit for bit, over a fifth to a quarter of the bytes (1 or 2 rows:
// block_panel_factored, below).
//
// Layout (uint8 (P, K / 32, bytes)): panel p of W = 32 | 48 output columns, one block of 32 k each:
//   Q4_1 (bytes = 20 W): d (W float16), m (W float16), then 16 rows of W bytes, row r byte c holding
//        q[k = 2r] in its low nibble and q[k = 2r + 1] in its high one (column c).
//   Q8_0 (bytes = 34 W): d (W float16), then 32 rows of W int8, row r the q of k = r.
// ---------------------------------------------------------------------------------------------------
constexpr int64_t kQ4 = 20, kQ8 = 34;  // bytes a column of a panel takes in a block of 32 k

// The blocks of 16 rows at once, one row a lane: v[i] holds weight i of each row's block (32). (Q4_0's,
// below, are found as Q4_1's.)
// Q4_1: a block's weights are fma(d, q, m) for its smallest one m (q = 0 there) and a d near (max - m) / 15
// (the largest q is 15), both float16; Q8_0: d * q for a d near max |w| / 127. Each d tried is that guess
// rounded to float16 and its neighbours (where a quantizer's rounding may have put it), q = round((w -
// m) / d), kept where every fma(d, q, m) is the weight exactly. Writes d (and m) as float16 bits and the
// q of each weight; false where a lane finds none.
bool lanes_block(const __m512* v, bool q4, __m256i& d_out, __m256i& m_out, __m512i* q) {
  __m512 lo = v[0], hi = v[0];
  for (int i = 1; i < 32; ++i) lo = _mm512_min_ps(lo, v[i]), hi = _mm512_max_ps(hi, v[i]);
  __m512 m = _mm512_setzero_ps(), span;
  __mmask16 ok = 0xFFFF;
  if (q4) {
    m_out = _mm512_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    m = lo;
    ok = _mm512_cmp_ps_mask(_mm512_cvtph_ps(m_out), lo, _CMP_EQ_OQ);  // (m exactly a float16)
    span = _mm512_div_ps(_mm512_sub_ps(hi, lo), _mm512_set1_ps(15.f));
  } else {
    span = _mm512_div_ps(_mm512_max_ps(hi, _mm512_sub_ps(_mm512_setzero_ps(), lo)), _mm512_set1_ps(127.f));
  }
  const __m512 qlo = _mm512_set1_ps(q4 ? 0.f : -128.f), qhi = _mm512_set1_ps(q4 ? 15.f : 127.f);
  __m512i dbits = _mm512_setzero_si512();
  for (int i = 0; i < 32; ++i) q[i] = _mm512_setzero_si512();
  __mmask16 done = 0;
  // Lanes `try_` with d of float16 bits `bits`: those whose every weight comes back exactly are done.
  auto attempt = [&](__m512i bits, __mmask16 try_) {
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(bits));
    // (times 1 / d: (w - m) / d is within 2^-20 of an integer wherever w is exact, and the check is exact;
    // d = 0, where every weight is m: q = 0, and a NaN or infinite weight fails)
    const __m512 r = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_NEQ_UQ), _mm512_set1_ps(1.f), d);
    __m512 qs[32];
    for (int i = 0; i < 32; ++i) {
      qs[i] = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(v[i], m), r), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      try_ &= _mm512_cmp_ps_mask(qs[i], qlo, _CMP_GE_OQ) & _mm512_cmp_ps_mask(qs[i], qhi, _CMP_LE_OQ) &
              _mm512_cmp_ps_mask(_mm512_fmadd_ps(d, qs[i], m), v[i], _CMP_EQ_OQ);
    }
    for (int i = 0; i < 32; ++i) q[i] = _mm512_mask_mov_epi32(q[i], try_, _mm512_cvtps_epi32(qs[i]));
    dbits = _mm512_mask_mov_epi32(dbits, try_, bits);
    done |= try_;
  };
  const __mmask16 flat = ok & _mm512_cmp_ps_mask(span, _mm512_setzero_ps(), _CMP_EQ_OQ);
  if (flat) attempt(_mm512_setzero_si512(), flat);  // (d = 0)
  const __m512i guess = _mm512_cvtepu16_epi32(_mm512_cvtps_ph(span, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (int delta : {0, -1, 1, -2, 2}) {
    const __m512i bits = _mm512_add_epi32(guess, _mm512_set1_epi32(delta));
    // (positive finite float16s, in lanes still to find)
    const __mmask16 try_ = ok & ~done & _mm512_cmpgt_epi32_mask(bits, _mm512_setzero_si512()) &
                           _mm512_cmplt_epi32_mask(bits, _mm512_set1_epi32(0x7C00));
    if (try_) attempt(bits, try_);
  }
  if (q4 && done != 0xFFFF) {
    // Q4_0's blocks, w = d (q - 8), are Q4_1's with m = -8 d: m the weight of largest magnitude (its q is
    // 0), d = m / -8 (exact), of either sign.
    const __m512 m0 = _mm512_mask_mov_ps(hi, _mm512_cmp_ps_mask(_mm512_sub_ps(_mm512_setzero_ps(), lo), hi, _CMP_GT_OQ), lo);
    const __m512 d0 = _mm512_mul_ps(m0, _mm512_set1_ps(-0.125f));
    const __m256i m0h = _mm512_cvtps_ph(m0, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                  d0h = _mm512_cvtps_ph(d0, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __mmask16 try_ = ~done & _mm512_cmp_ps_mask(_mm512_cvtph_ps(m0h), m0, _CMP_EQ_OQ) &
                           _mm512_cmp_ps_mask(_mm512_cvtph_ps(d0h), d0, _CMP_EQ_OQ);
    if (try_) {
      const __mmask16 before = done;
      m = _mm512_mask_mov_ps(m, try_, m0);
      attempt(_mm512_cvtepu16_epi32(d0h), try_);
      m_out = _mm256_mask_mov_epi16(m_out, done & ~before, m0h);
    }
  }
  d_out = _mm512_cvtepi32_epi16(dbits);
  return done == 0xFFFF;
}

// The weight's blocks in one format (q4: Q4_1, else Q8_0) into out, or false where a block has none.
bool pack_format(const float* w, int64_t N, int64_t K, int64_t W, bool q4, uint8_t* out) {
  const int64_t nb = K / 32, block = (q4 ? kQ4 : kQ8) * W;
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(static_cast<int>(K)));
  std::atomic<bool> ok{true};
  at::parallel_for(0, N / 16, 1, [&](int64_t a, int64_t b) {
    __m512 v[32];
    __m512i q[32];
    for (int64_t g = a; g < b && ok.load(std::memory_order_relaxed); ++g) {  // rows 16 g .. 16 g + 15
      const int64_t p = 16 * g / W, c = 16 * g % W;  // their panel, and their first column in it
      for (int64_t kb = 0; kb < nb; ++kb) {
        const float* base = w + 16 * g * K + 32 * kb;
        if (kb + 4 < nb)  // (each row's lines four blocks ahead: 16 streams the hardware's prefetcher loses)
          for (int i = 0; i < 16; ++i) {
            _mm_prefetch(reinterpret_cast<const char*>(base + i * K + 128), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(base + i * K + 144), _MM_HINT_T0);
          }
        for (int i = 0; i < 32; ++i) v[i] = _mm512_i32gather_ps(rows, base + i, 4);
        __m256i d, m;
        if (!lanes_block(v, q4, d, m, q)) return void(ok = false);
        uint8_t* o = out + (p * nb + kb) * block;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 2 * c), d);
        if (q4) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 2 * W + 2 * c), m);
          for (int r = 0; r < 16; ++r)  // row r: q of k = 2r in the low nibble, of k = 2r + 1 in the high one
            _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 4 * W + r * W + c),
                             _mm512_cvtepi32_epi8(_mm512_or_si512(q[2 * r], _mm512_slli_epi32(q[2 * r + 1], 4))));
        } else {
          for (int r = 0; r < 32; ++r)
            _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 2 * W + r * W + c), _mm512_cvtepi32_epi8(q[r]));
        }
      }
    }
  });
  return ok;
}

at::Tensor pack_blocks(const at::Tensor& weight) {
  TORCH_CHECK_TYPE(weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
                   "pack_blocks: weight must be a float32 CPU tensor, got ", weight.scalar_type(), " on ", weight.device());
  TORCH_CHECK_VALUE(weight.dim() == 2, "pack_blocks: weight must be (N, K), got shape ", weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t W = N % 48 == 0 ? 48 : N % 32 == 0 ? 32 : 0;
  if (W == 0 || K == 0 || K % 32 != 0 || N == 0) return at::empty({0}, weight.options().dtype(at::kByte));
  const at::Tensor w = weight.contiguous();
  for (bool q4 : {true, false}) {
    at::Tensor out = at::empty({N / W, K / 32, (q4 ? kQ4 : kQ8) * W}, weight.options().dtype(at::kByte));
    if (pack_format(w.data_ptr<float>(), N, K, W, q4, out.data_ptr<uint8_t>())) return out;
  }
  return at::empty({0}, weight.options().dtype(at::kByte));
}

// The `bytes` at p into the caches (a panel's block four blocks ahead: one stream, ahead of its use).
inline void prefetch_block(const uint8_t* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(p + line), _MM_HINT_T0);
}

// 16 float16s at p as float32s (a block's d or m for 16 columns).
inline __m512 halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// A Q4_1 block's row of 16 columns at p (16 bytes) as floats: q0 the q of its k = 2r (low nibbles), q1 of
// k = 2r + 1 (high nibbles).
inline void q4_row(const uint8_t* p, __m512& q0, __m512& q1) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  q0 = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF)));
  q1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}

// A Q8_0 block's row of 16 columns at p (16 int8s) as floats.
inline __m512 q8_row(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// y[m, panel's columns] for the M rows of x: one panel of nb blocks, as panel<M, NP> but the weights
// rebuilt from their blocks (Q4: Q4_1, else Q8_0). Each accumulator takes k in order, as panel's.
template <bool Q4, int M, int NP>
void block_panel(const float* x, int64_t ldx, const uint8_t* blk, int64_t nb, float* y, int64_t ldy,
                 const float* bias) {
  constexpr int64_t W = 16 * NP, block = (Q4 ? kQ4 : kQ8) * W;
  __m512 acc[M][NP];
  init_rows<M, NP>(acc, bias);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = blk + b * block;
    const float* xk = x + 32 * b;
    prefetch_block(p + 4 * block, block);
    __m512 d[NP], mv[NP];
    for (int j = 0; j < NP; ++j) {
      d[j] = halves(p + 32 * j);
      if (Q4) mv[j] = halves(p + 2 * W + 32 * j);
    }
    if constexpr (Q4) {
      for (int r = 0; r < 16; ++r) {
        __m512 w0[NP], w1[NP];
#pragma GCC unroll 4
        for (int j = 0; j < NP; ++j) {
          q4_row(p + 4 * W + r * W + 16 * j, w0[j], w1[j]);
          w0[j] = _mm512_fmadd_ps(d[j], w0[j], mv[j]);
          w1[j] = _mm512_fmadd_ps(d[j], w1[j], mv[j]);
        }
        fma_rows<M, NP>(acc, xk, ldx, 2 * r, w0);
        fma_rows<M, NP>(acc, xk, ldx, 2 * r + 1, w1);
      }
    } else {
      for (int r = 0; r < 32; ++r) {
        __m512 wv[NP];
#pragma GCC unroll 4
        for (int j = 0; j < NP; ++j) wv[j] = _mm512_mul_ps(d[j], q8_row(p + 2 * W + r * W + 16 * j));
        fma_rows<M, NP>(acc, xk, ldx, r, wv);
      }
    }
  }
  store_rows<M, NP>(acc, y, ldy);
}

// One or two rows (M <= 2): block_panel's sums with fewer operations a weight, the block's factored out,
// sum_k x_k (d q_k + m) = d sum_k x_k q_k + m sum_k x_k (xsum: each row's sums over its blocks, nb each):
// no FMA rebuilds each weight, where a row or two leaves the core more arithmetic than the memory's time
// (SmolLM2's step, 1 row: 4.65 -> 3.9 ms, Intel Xeon, 2 threads). The sums float32, in another order.
template <bool Q4, int M, int NP>
void block_panel_factored(const float* x, int64_t ldx, const float* xsum, const uint8_t* blk, int64_t nb, float* y,
                          int64_t ldy, const float* bias) {
  constexpr int64_t W = 16 * NP, block = (Q4 ? kQ4 : kQ8) * W;
  __m512 acc[M][NP];
  init_rows<M, NP>(acc, bias);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = blk + b * block;
    const float* xk = x + 32 * b;
    prefetch_block(p + 4 * block, block);
    __m512 sum[M][NP];
    init_rows<M, NP>(sum, nullptr);
    if constexpr (Q4) {
      for (int r = 0; r < 16; ++r) {
#pragma GCC unroll 4
        for (int j = 0; j < NP; ++j) {
          __m512 q0, q1;
          q4_row(p + 4 * W + r * W + 16 * j, q0, q1);
          for (int m = 0; m < M; ++m)
            sum[m][j] = _mm512_fmadd_ps(_mm512_set1_ps(xk[m * ldx + 2 * r + 1]), q1,
                                        _mm512_fmadd_ps(_mm512_set1_ps(xk[m * ldx + 2 * r]), q0, sum[m][j]));
        }
      }
    } else {
      for (int r = 0; r < 32; ++r) {
#pragma GCC unroll 4
        for (int j = 0; j < NP; ++j) {
          const __m512 q = q8_row(p + 2 * W + r * W + 16 * j);
          for (int m = 0; m < M; ++m) sum[m][j] = _mm512_fmadd_ps(_mm512_set1_ps(xk[m * ldx + r]), q, sum[m][j]);
        }
      }
    }
    for (int j = 0; j < NP; ++j) {
      const __m512 d = halves(p + 32 * j);
      for (int m = 0; m < M; ++m) acc[m][j] = _mm512_fmadd_ps(d, sum[m][j], acc[m][j]);
      if constexpr (Q4) {
        const __m512 mv = halves(p + 2 * W + 32 * j);
        for (int m = 0; m < M; ++m) acc[m][j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsum[m * nb + b]), acc[m][j]);
      }
    }
  }
  store_rows<M, NP>(acc, y, ldy);
}

// Each row's sum over each block of 32 of its K inputs, what block_panel_factored takes: xsum (M, K / 32).
void block_sums(int M, const float* x, int64_t K, float* xsum) {
  const int64_t nb = K / 32;
  for (int m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      float t = 0.f;
      for (int i = 0; i < 32; ++i) t += x[m * K + 32 * b + i];
      xsum[m * nb + b] = t;
    }
}

// Panels p0..p1 of the product of the M rows of x (K each) by a weight's blocks: y's columns there (N a
// row). One or two rows take block_panel_factored (xsum: block_sums of x), more block_panel.
template <bool Q4, int NP>
void block_range(int M, const float* x, int64_t K, const float* xsum, const uint8_t* blocks, int64_t p0, int64_t p1,
                 float* y, int64_t N, const float* bias) {
  using Fn = void (*)(const float*, int64_t, const uint8_t*, int64_t, float*, int64_t, const float*);
  static constexpr Fn fns[8] = {block_panel<Q4, 1, NP>, block_panel<Q4, 2, NP>, block_panel<Q4, 3, NP>,
                                block_panel<Q4, 4, NP>, block_panel<Q4, 5, NP>, block_panel<Q4, 6, NP>,
                                block_panel<Q4, 7, NP>, block_panel<Q4, 8, NP>};
  using Factored = void (*)(const float*, int64_t, const float*, const uint8_t*, int64_t, float*, int64_t, const float*);
  constexpr int64_t W = 16 * NP;
  const int64_t nb = K / 32, panel = nb * (Q4 ? kQ4 : kQ8) * W;
  const Factored factored = M == 1 ? block_panel_factored<Q4, 1, NP> : block_panel_factored<Q4, 2, NP>;
  for (int64_t p = p0; p < p1; ++p) {
    const float* b = bias ? bias + p * W : nullptr;
    if (M <= 2)
      factored(x, K, xsum, blocks + p * panel, nb, y + p * W, N, b);
    else
      fns[M - 1](x, K, blocks + p * panel, nb, y + p * W, N, b);
  }
}

// A weight's blocks as block_linear reads them (see its checks): the format, the panels' width, P panels.
struct Blocks {
  const uint8_t* data;
  bool q4;
  int64_t W, P, K, N;
};

// The blocks of argument `name` of operator `op`, checked to be pack_blocks' output.
Blocks blocks_of(const at::Tensor& blocks, const char* op, const char* name) {
  TORCH_CHECK_TYPE(blocks.scalar_type() == at::kByte && blocks.device().is_cpu(), op, ": ", name,
                   " must be a uint8 CPU tensor (pack_blocks'), got ", blocks.scalar_type(), " on ", blocks.device());
  const int64_t last = blocks.dim() == 3 ? blocks.size(2) : 0;
  const bool q4 = last == kQ4 * 32 || last == kQ4 * 48, q8 = last == kQ8 * 32 || last == kQ8 * 48;
  TORCH_CHECK_VALUE(blocks.is_contiguous() && (q4 || q8) && blocks.size(1) > 0, op, ": ", name,
                    " must be pack_blocks' (P, K / 32, 20 W | 34 W), W = 32 | 48, contiguous, got shape ", blocks.sizes());
  const int64_t W = last / (q4 ? kQ4 : kQ8);
  return {blocks.data_ptr<uint8_t>(), q4, W, blocks.size(0), 32 * blocks.size(1), blocks.size(0) * W};
}

// block_range for any format and width.
void block_range_of(const Blocks& w, int M, const float* x, const float* xsum, int64_t p0, int64_t p1, float* y,
                    const float* bias) {
  if (w.q4)
    w.W == 48 ? block_range<true, 3>(M, x, w.K, xsum, w.data, p0, p1, y, w.N, bias)
              : block_range<true, 2>(M, x, w.K, xsum, w.data, p0, p1, y, w.N, bias);
  else
    w.W == 48 ? block_range<false, 3>(M, x, w.K, xsum, w.data, p0, p1, y, w.N, bias)
              : block_range<false, 2>(M, x, w.K, xsum, w.data, p0, p1, y, w.N, bias);
}

// The product of the M rows of x (w.K each) by the blocks w into y (M rows of w.N), plus bias: the
// panels shared by torch's threads.
void block_product(const Blocks& w, int M, const float* x, float* y, const float* bias) {
  std::vector<float> xsum(M <= 2 ? M * w.K / 32 : 0);  // (each row's sum over each block)
  if (M <= 2) block_sums(M, x, w.K, xsum.data());
  at::parallel_for(0, w.P, 1, [&](int64_t a, int64_t e) { block_range_of(w, M, x, xsum.data(), a, e, y, bias); });
}

at::Tensor block_linear(const at::Tensor& x, const at::Tensor& blocks, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat && x.device().is_cpu(), "block_linear: x must be a float32 CPU tensor, got ",
                   x.scalar_type(), " on ", x.device());
  const Blocks w = blocks_of(blocks, "block_linear", "blocks");
  return by_passes("block_linear", x, w.K, w.N, bias,
                   [&](int M, const float* xr, float* yr, const float* b) { block_product(w, M, xr, yr, b); });
}


// ---------------------------------------------------------------------------------------------------
// block_layer: a whole block of a Llama-style model (RMSNorm, fused q/k/v, RoPE, grouped-query attention
// over the cache's filled slots, SwiGLU, no biases) for one new token per row, its projections read from
// their blocks, as one operator.
//
// The compiled step on block_linear and decode_attention calls 5 operators and 3 of inductor's loops a
// layer: each a trip through the dispatcher, an allocation, and an OpenMP fork and join while the other
// thread waits (SmolLM2's step, 1 row: the products 4.0 ms of 6.8, Intel Xeon, 2 threads). Here a layer
// is one OpenMP region: the threads share each product's panels and the attention's query heads, and
// meet at a barrier between them; the small vectors in between (the residual, the norms, the SwiGLU)
// each thread computes for itself, in the same order as the other.
// ---------------------------------------------------------------------------------------------------

// RMSNorm of the M rows of x (C each) times w into h (the sum of squares in double).
void rms_rows(int M, const float* x, int64_t C, const float* w, float eps, float* h) {
  for (int m = 0; m < M; ++m) {
    const float* r = x + m * C;
    double squares = 0.0;
    for (int64_t i = 0; i < C; ++i) squares += static_cast<double>(r[i]) * r[i];
    const float inv = 1.f / std::sqrt(static_cast<float>(squares / C) + eps);
    for (int64_t i = 0; i < C; ++i) h[m * C + i] = r[i] * inv * w[i];
  }
}

// RoPE of one head's hd features x (feature i and i + hd / 2 a pair, as attnlab.positions.apply_rope
// turns them) at the angles whose cosines and sines are c and s (hd each) into y; without c, a copy.
// bf: x * c rounded to bfloat16 first, as a bfloat16 forward's addcmul(x * cos, ...) takes it.
void rope_head(const float* x, const float* c, const float* s, int64_t hd, float* y, bool bf = false) {
  if (c == nullptr) return void(std::copy(x, x + hd, y));
  const int64_t half = hd / 2;
  if (!bf) {
    for (int64_t i = 0; i < half; ++i) y[i] = x[i] * c[i] - x[i + half] * s[i];
    for (int64_t i = half; i < hd; ++i) y[i] = x[i] * c[i] + x[i - half] * s[i];
    return;
  }
  auto xc = [&](int64_t i) { return static_cast<float>(at::BFloat16(x[i] * c[i])); };
  for (int64_t i = 0; i < half; ++i) y[i] = xc(i) - x[i + half] * s[i];
  for (int64_t i = half; i < hd; ++i) y[i] = xc(i) + x[i - half] * s[i];
}

// A product's weight as layer() and block_step multiply it: a GGUF file's blocks (pack_blocks'), or a
// bfloat16 matrix where it lies (a bfloat16 model's). P: the units its threads share, panels or stretches
// of 8 rows.
struct Weight {
  Blocks blocks{};  // (blocks.data null: a bfloat16 matrix, as it lies or packed by pack_amx)
  const uint16_t* bf16 = nullptr;
  const uint16_t* amx = nullptr;  // (a bfloat16 matrix packed by pack_amx: units of 48 columns)
  int64_t K = 0, N = 0, P = 0, unit = 8;
};

// (matrix: a bfloat16 model's, else blocks: each a TypeError naming the argument where it is not)
Weight weight_of(const at::Tensor& t, bool matrix, const char* op, const char* name) {
  Weight w;
  if (matrix && t.dim() == 5) {  // (pack_amx's)
    check_amx_weight(t, op, name);
    w.amx = reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
    w.K = t.size(1) * 32, w.N = t.size(0) * 16, w.P = w.N / 48, w.unit = 48;
  } else if (matrix) {
    check_bf16_weight(t, op, name);
    w.bf16 = reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
    w.K = t.size(1), w.N = t.size(0), w.P = (w.N + 7) / 8;
  } else {
    w.blocks = blocks_of(t, op, name);
    w.K = w.blocks.K, w.N = w.blocks.N, w.P = w.blocks.P;
  }
  return w;
}

// The M rows of x (w.K each) times w's units p0 .. p1 - 1 into y (M rows of w.N); xsum: the rows' block
// sums (blocks, M <= 2; see block_range).
void weight_range(const Weight& w, int M, const float* x, const float* xsum, int64_t p0, int64_t p1, float* y) {
  if (w.amx != nullptr) return amx_range(w.amx, w.K, M, x, p0, p1, y, w.N);
  if (w.bf16 != nullptr) return bf16_range(w.bf16, w.N, w.K, M, x, p0, p1, y, w.N, nullptr);
  block_range_of(w.blocks, M, x, xsum, p0, p1, y, nullptr);
}

// The product of the M rows of x by w into y, the units shared by torch's threads.
void weight_product(const Weight& w, int M, const float* x, float* y) {
  std::vector<float> xsum(w.blocks.data != nullptr && M <= 2 ? M * w.K / 32 : 0);
  if (!xsum.empty()) block_sums(M, x, w.K, xsum.data());
  at::parallel_for(0, w.P, 1, [&](int64_t a, int64_t e) { weight_range(w, M, x, xsum.data(), a, e, y); });
}

// p[0 .. n) rounded to bfloat16's precision (to the nearest even; a NaN stays a NaN), as a bfloat16
// model's tensors hold them between its operations.
void round_bf16(float* p, int64_t n) {
  const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(p + i);
    const __m512i b = _mm512_castps_si512(v);
    const __m512i r = _mm512_and_si512(
        _mm512_add_epi32(_mm512_add_epi32(b, bias), _mm512_and_si512(_mm512_srli_epi32(b, 16), one)), top);
    _mm512_storeu_ps(p + i, _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_castsi512_ps(r), v));
  }
  for (; i < n; ++i) p[i] = static_cast<float>(at::BFloat16(p[i]));
}

// block_layer's work, on float32 caches and activations (T = float, the products' weights blocks) or a
// bfloat16 model's (T = at::BFloat16, its bfloat16 matrices: each operation's output rounded to bfloat16
// as the model's forward holds it, RoPE's x cos too; the sums float32): the block's output (T), queries
// and heads' outputs (float32); with wp, the attention's weights there ((B, Hkv, G, wlen): the filled
// slots' of each query, a row of wlen).
template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer(const at::Tensor& x, const std::optional<at::Tensor>& cos,
                                                     const std::optional<at::Tensor>& sin, const at::Tensor& keys,
                                                     const at::Tensor& values, const at::Tensor& slot, const at::Tensor& norm1,
                                                     const at::Tensor& qkv, const at::Tensor& out, const at::Tensor& norm2,
                                                     const at::Tensor& up, const at::Tensor& down, int64_t heads, double scale,
                                                     double eps, float* wp, int64_t wlen) {
  constexpr bool bf = std::is_same_v<T, at::BFloat16>;
  const auto dtype = bf ? at::kBFloat16 : at::kFloat;
  for (const at::Tensor* t : {&x, &keys, &values})
    TORCH_CHECK_TYPE(t->scalar_type() == dtype && t->device().is_cpu(), "block_layer: x, keys and values must be ",
                     bf ? "bfloat16" : "float32", " CPU tensors, got ", t->scalar_type(), " on ", t->device());
  for (const at::Tensor* t : {&norm1, &norm2})
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat && t->device().is_cpu(),
                     "block_layer: the norms' weights must be float32 CPU tensors, got ", t->scalar_type(), " on ", t->device());
  TORCH_CHECK_VALUE(x.dim() == 3 && x.size(1) == 1 && x.size(0) >= 1 && x.size(0) <= 8,
                    "block_layer: x must be (B, 1, C) with B from 1 to 8, got shape ", x.sizes());
  const int64_t B = x.size(0), C = x.size(2);
  TORCH_CHECK_VALUE(keys.dim() == 4 && keys.sizes() == values.sizes() && keys.size(0) == B && keys.is_contiguous() &&
                        values.is_contiguous() && keys.size(1) > 0 && keys.size(3) % 2 == 0,
                    "block_layer: keys and values must be contiguous (B, Hkv, M, hd), hd even, got ", keys.sizes(), ", ",
                    values.sizes());
  const int64_t Hkv = keys.size(1), M = keys.size(2), hd = keys.size(3), H = heads;
  TORCH_CHECK_VALUE(H > 0 && H % Hkv == 0, "block_layer: heads must be a multiple of the cache's ", Hkv,
                    " key heads, got ", H);
  const int64_t pos = slot_of(slot, M, "block_layer"), S = pos + 1, G = H / Hkv;
  // (a float32 model's products: its blocks; a bfloat16 model's: its matrices)
  const Weight wqkv = weight_of(qkv, bf, "block_layer", "qkv"), wo = weight_of(out, bf, "block_layer", "out"),
               wup = weight_of(up, bf, "block_layer", "up"), wdown = weight_of(down, bf, "block_layer", "down");
  const int64_t Nq = H * hd, Nkv = Hkv * hd, Nqkv = Nq + 2 * Nkv, F = wup.N / 2;
  TORCH_CHECK_VALUE(wqkv.K == C && wqkv.N == Nqkv && wo.K == Nq && wo.N == C && wup.K == C && wup.N % 2 == 0 &&
                        wdown.K == F && wdown.N == C,
                    "block_layer: the products must multiply (C) -> (H + 2 Hkv) hd (qkv), H hd -> C (out), C -> 2 F (up) and "
                    "F -> C (down) for C = ",
                    C, ", H = ", H, ", Hkv = ", Hkv, ", hd = ", hd, "; got (K, N) (", wqkv.K, ", ", wqkv.N, "), (", wo.K, ", ",
                    wo.N, "), (", wup.K, ", ", wup.N, "), (", wdown.K, ", ", wdown.N, ")");
  TORCH_CHECK_VALUE(norm1.numel() == C && norm2.numel() == C && norm1.is_contiguous() && norm2.is_contiguous(),
                    "block_layer: the norms' weights must be (", C, "), got ", norm1.sizes(), " and ", norm2.sizes());
  const bool rope = cos.has_value() && cos->defined();
  TORCH_CHECK_VALUE(rope == (sin.has_value() && sin->defined()), "block_layer: cos and sin must both be given or neither");
  if (rope)
    for (const at::Tensor* t : {&*cos, &*sin})
      TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat && t->numel() == hd && t->is_contiguous(),
                        "block_layer: cos and sin must be float32, contiguous, ", hd, " values each, got ", t->scalar_type(),
                        " ", t->sizes());
  const at::Tensor xc = x.contiguous();
  const auto f32 = xc.options().dtype(at::kFloat);
  at::Tensor y = at::empty_like(xc), q = at::empty({B, H, 1, hd}, f32), att = at::empty({B, Hkv, G, hd}, f32);
  const T* xp = xc.data_ptr<T>();
  const float *n1 = norm1.data_ptr<float>(), *n2 = norm2.data_ptr<float>();
  const float *cp = rope ? cos->data_ptr<float>() : nullptr, *sp = rope ? sin->data_ptr<float>() : nullptr;
  T *kp = keys.data_ptr<T>(), *vp = values.data_ptr<T>();
  float *qp = q.data_ptr<float>(), *ap = att.data_ptr<float>();
  std::vector<float> qkvb(B * Nqkv), ob(B * C), gub(B * 2 * F), db(B * C);  // (the products' outputs, shared)
  const float sc = static_cast<float>(scale), ep = static_cast<float>(eps);
  const int64_t wide = std::max(C, std::max(F, Nq));
  const int threads = at::in_parallel_region() ? 1 : at::get_num_threads();
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), n = omp_get_num_threads();
    auto share = [&](int64_t total) { return std::pair<int64_t, int64_t>(total * t / n, total * (t + 1) / n); };
    // (bfloat16: a tensor of the model's forward, rounded as it holds it)
    auto held = [&](float* p, int64_t count) {
      if (bf) round_bf16(p, count);
    };
    auto product = [&](const Weight& w, const float* in, const float* sums, float* y) {  // (this thread's units)
      const auto [a, b] = share(w.P);
      weight_range(w, B, in, sums, a, b, y);
      if (bf && a < b)  // (its outputs: the rows of its stretches of 8)
        for (int64_t m = 0; m < B; ++m) held(y + m * w.N + w.unit * a, std::min(w.N, w.unit * b) - w.unit * a);
    };
    // (each thread's own: the residual stream, a product's input and its block sums)
    std::vector<float> res(xp, xp + B * C), h(B * wide), hs(B * wide / 32 + 1), e(G * S), row(hd);
    float* sums = B <= 2 && !bf ? hs.data() : nullptr;
    // The norm, then q, k and v.
    rms_rows(B, res.data(), C, n1, ep, h.data());
    held(h.data(), B * C);
    if (sums != nullptr) block_sums(B, h.data(), C, sums);
    product(wqkv, h.data(), sums, qkvb.data());
#pragma omp barrier
    // RoPE; the new key and value into their slot (each thread its key heads), the queries (its query heads).
    const auto [k0, k1] = share(B * Hkv);
    for (int64_t bh = k0; bh < k1; ++bh) {
      const float* r = qkvb.data() + bh / Hkv * Nqkv + Nq + bh % Hkv * hd;
      rope_head(r, cp, sp, hd, row.data(), bf);
      std::copy(row.begin(), row.end(), kp + (bh * M + pos) * hd);
      std::copy(r + Nkv, r + Nkv + hd, vp + (bh * M + pos) * hd);
    }
    const auto [q0, q1] = share(B * H);
    for (int64_t i = q0; i < q1; ++i) rope_head(qkvb.data() + i / H * Nqkv + i % H * hd, cp, sp, hd, qp + i * hd, bf);
    held(qp + q0 * hd, (q1 - q0) * hd);
#pragma omp barrier
    // Attention: this thread's query heads, a run of those sharing a key head at a time.
    for (int64_t i = q0; i < q1;) {
      const int64_t bh = i / G, g0 = i % G, g1 = std::min(G, g0 + (q1 - i));
      attend_group(qp, kp, vp, ap, wp, bh, g0, g1, G, S, M, hd, sc, e.data(), wlen);
      i += g1 - g0;
    }
    held(ap + q0 * hd, (q1 - q0) * hd);
#pragma omp barrier
    // The output projection, the residual, the norm, then the gate and up projections.
    if (sums != nullptr) block_sums(B, ap, Nq, sums);
    product(wo, ap, sums, ob.data());
#pragma omp barrier
    for (int64_t i = 0; i < B * C; ++i) res[i] += ob[i];
    held(res.data(), B * C);
    rms_rows(B, res.data(), C, n2, ep, h.data());
    held(h.data(), B * C);
    if (sums != nullptr) block_sums(B, h.data(), C, sums);
    product(wup, h.data(), sums, gub.data());
#pragma omp barrier
    // SwiGLU: silu(gate) * up, as ATen's silu computes it (x / (1 + exp(-x))); then the down projection.
    using Vec = at::vec::Vectorized<float>;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < F; i += Vec::size()) {
        const int c = static_cast<int>(std::min<int64_t>(Vec::size(), F - i));
        const Vec gate = Vec::loadu(gub.data() + b * 2 * F + i, c), upv = Vec::loadu(gub.data() + b * 2 * F + F + i, c);
        float* hi = h.data() + b * F + i;
        (gate / (Vec(1.f) + gate.neg().exp())).store(hi, c);
        held(hi, c);  // (bfloat16: silu's output, then the product's)
        (Vec::loadu(hi, c) * upv).store(hi, c);
        held(hi, c);
      }
    if (sums != nullptr) block_sums(B, h.data(), F, sums);
    product(wdown, h.data(), sums, db.data());
#pragma omp barrier
    if (t == 0) {
      T* yp = y.data_ptr<T>();
      for (int64_t i = 0; i < B * C; ++i) yp[i] = res[i] + db[i];
    }
  }
  return {y, q, att};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> block_layer(
    const at::Tensor& x, const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin, const at::Tensor& keys,
    const at::Tensor& values, const at::Tensor& slot, const at::Tensor& norm1, const at::Tensor& qkv, const at::Tensor& out,
    const at::Tensor& norm2, const at::Tensor& up, const at::Tensor& down, int64_t heads, double scale, double eps,
    bool with_weights) {
  at::Tensor weights = at::empty({0}, x.options());
  if (with_weights && keys.dim() == 4 && heads > 0)  // (the shapes checked by layer)
    weights = at::zeros({keys.size(0), keys.size(1), heads / std::max<int64_t>(1, keys.size(1)), keys.size(2)}, x.options());
  auto [y, q, att] = layer<float>(x, cos, sin, keys, values, slot, norm1, qkv, out, norm2, up, down, heads, scale, eps,
                                  with_weights ? weights.data_ptr<float>() : nullptr, weights.dim() == 4 ? weights.size(3) : 0);
  return {y, q, att, weights};
}

// block_step: every block of a model whose blocks are all block_layer's and share one RoPE, then the
// final RMSNorm and the head (blocks too): a decoding step of one new token per row in one call, no
// graph (SmolLM2: one call through the dispatcher, from Python, where a compiled step checked its
// guards over some 700 tensors, ran its wrapper and called block_layer 30 times and the head). `layers`: 6 tensors a block, block_layer's
// weights in order; `positions`: each block's cache's record of its slots' positions (B, M), or none.
// Returns the logits (B, V) and, with `with_weights`, every block's attention weights over the filled
// slots, (L, B, H, slot + 1) (else an empty tensor).
template <typename T>
std::tuple<at::Tensor, at::Tensor> step_of(const at::Tensor& x, const std::optional<at::Tensor>& cos,
                                           const std::optional<at::Tensor>& sin, at::TensorList keys, at::TensorList values,
                                           at::TensorList positions, const at::Tensor& slot, at::TensorList layers,
                                           int64_t heads, double scale, double eps, const at::Tensor& final_norm,
                                           const at::Tensor& head, bool with_weights) {
  const int64_t L = static_cast<int64_t>(keys.size());
  TORCH_CHECK_VALUE(L >= 1 && values.size() == keys.size() && layers.size() == 6 * keys.size(),
                    "block_step: keys and values must be one tensor a block and layers six, got ", keys.size(), ", ",
                    values.size(), " and ", layers.size());
  TORCH_CHECK_VALUE(x.dim() == 3 && final_norm.scalar_type() == at::kFloat && final_norm.numel() == x.size(2) &&
                        final_norm.is_contiguous(),
                    "block_step: final_norm must be float32 (C) for x (B, 1, C), got ", final_norm.scalar_type(), " ",
                    final_norm.sizes(), " for x ", x.sizes());
  constexpr bool bf = std::is_same_v<T, at::BFloat16>;
  const Weight w = weight_of(head, bf, "block_step", "head");
  TORCH_CHECK_VALUE(w.K == x.size(2), "block_step: head must multiply (", x.size(2), "), got K = ", w.K);
  TORCH_CHECK_VALUE(positions.empty() || positions.size() == keys.size(),
                    "block_step: positions must be one tensor a block or none, got ", positions.size());
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor weights = at::empty({0}, f32);
  const int64_t B = x.size(0), M = keys[0].dim() == 4 ? keys[0].size(2) : 0;
  const int64_t pos = slot_of(slot, M, "block_step");
  if (with_weights) weights = at::empty({L, B, heads, pos + 1}, f32);  // (every entry written)
  at::Tensor h = x;
  for (int64_t l = 0; l < L; ++l) {
    TORCH_CHECK_VALUE(!with_weights || keys[l].sizes() == keys[0].sizes(),
                      "block_step: with weights, every block's cache must be ", keys[0].sizes(), ", got ", keys[l].sizes());
    const at::Tensor* t = layers.data() + 6 * l;
    if (!positions.empty()) {  // (as the eager update(): the cache records the position of the slot)
      const at::Tensor& p = positions[l];
      TORCH_CHECK_VALUE(p.scalar_type() == at::kLong && p.dim() == 2 && p.size(0) == B && p.size(1) > pos,
                        "block_step: positions must be int64 (B, M) past the slot, got ", p.scalar_type(), " ", p.sizes());
      for (int64_t b = 0; b < B; ++b) p.data_ptr<int64_t>()[b * p.stride(0) + pos * p.stride(1)] = pos;
    }
    h = std::get<0>(layer<T>(h, cos, sin, keys[l], values[l], slot, t[0], t[1], t[2], t[3], t[4], t[5], heads, scale, eps,
                             with_weights ? weights.data_ptr<float>() + l * B * heads * (pos + 1) : nullptr, pos + 1));
  }
  const int64_t C = x.size(2);
  std::vector<float> hf(h.data_ptr<T>(), h.data_ptr<T>() + B * C), normed(B * C), logits(B * w.N);
  rms_rows(static_cast<int>(B), hf.data(), C, final_norm.data_ptr<float>(), static_cast<float>(eps), normed.data());
  if (bf) round_bf16(normed.data(), B * C);
  weight_product(w, static_cast<int>(B), normed.data(), logits.data());
  at::Tensor out = at::empty({B, w.N}, x.options());
  std::copy(logits.begin(), logits.end(), out.data_ptr<T>());  // (bfloat16: one rounding, to the nearest even)
  return {out, weights};
}

// block_step: every block of a model whose blocks are all block_layer's and share one RoPE, then the
// final RMSNorm and the head: a decoding step of one new token per row in one call, no graph (SmolLM2:
// one call through the dispatcher, from Python, where a compiled step checked its guards over some 700
// tensors, ran its wrapper and called block_layer 30 times and the head). A float32 model's products
// are its GGUF blocks; a bfloat16 model's, its bfloat16 matrices (bf16_linear's sums), each operation's
// output rounded to bfloat16 as its forward holds it. `layers`: 6 tensors a block, block_layer's weights
// in order (the norms' float32); `positions`: each block's cache's record of its slots' positions
// (B, M), or none. Returns the logits (B, V), in x's dtype, and, with `with_weights`, every block's
// attention weights over the filled slots, (L, B, H, slot + 1), float32 (else an empty tensor).
std::tuple<at::Tensor, at::Tensor> block_step(const at::Tensor& x, const std::optional<at::Tensor>& cos,
                                              const std::optional<at::Tensor>& sin, at::TensorList keys, at::TensorList values,
                                              at::TensorList positions, const at::Tensor& slot, at::TensorList layers,
                                              int64_t heads, double scale, double eps, const at::Tensor& final_norm,
                                              const at::Tensor& head, bool with_weights) {
  if (x.scalar_type() == at::kBFloat16)
    return step_of<at::BFloat16>(x, cos, sin, keys, values, positions, slot, layers, heads, scale, eps, final_norm, head,
                                 with_weights);
  return step_of<float>(x, cos, sin, keys, values, positions, slot, layers, heads, scale, eps, final_norm, head,
                        with_weights);
}

}  // namespace

TORCH_LIBRARY(attnlab_kernels, m) {
  m.def("rows_linear(Tensor x, Tensor panels, Tensor? bias) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor keys, Tensor values, Tensor slot, float scale) -> Tensor");
  m.def("decode_attention_weights(Tensor q, Tensor keys, Tensor values, Tensor slot, float scale) -> (Tensor, Tensor)");
  m.def("pack_blocks(Tensor weight) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("pack_amx(Tensor weight) -> Tensor");
  m.def("amx_available() -> bool", amx_available);
  m.def("block_linear(Tensor x, Tensor blocks, Tensor? bias) -> Tensor");
  m.def(
      "block_layer(Tensor x, Tensor? cos, Tensor? sin, Tensor(a!) keys, Tensor(b!) values, Tensor slot, Tensor norm1, "
      "Tensor qkv, Tensor out, Tensor norm2, Tensor up, Tensor down, int heads, float scale, float eps, bool weights) -> "
      "(Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "block_step(Tensor x, Tensor? cos, Tensor? sin, Tensor(a!)[] keys, Tensor(b!)[] values, Tensor(c!)[] positions, "
      "Tensor slot, Tensor[] layers, "
      "int heads, float scale, float eps, Tensor final_norm, Tensor head, bool weights) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(attnlab_kernels, CPU, m) {
  m.impl("rows_linear", rows_linear);
  m.impl("decode_attention", decode_attention);
  m.impl("decode_attention_weights", decode_attention_weights);
  m.impl("pack_blocks", pack_blocks);
  m.impl("bf16_linear", bf16_linear);
  m.impl("pack_amx", pack_amx);
  m.impl("block_linear", block_linear);
  m.impl("block_layer", block_layer);
  m.impl("block_step", block_step);
}

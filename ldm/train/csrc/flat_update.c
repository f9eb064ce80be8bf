/* The update around the step in one pass over flat fp32 buffers, on a CPU (`ldm.train.native`).

Paddle's CPU kernels make the update three passes: `adamw_` (weights, gradients, moments), the gradient clip's
scale before it and the EMA's `lerp_` after it, each reading the buffers again, each on one thread. Here one loop
reads each gradient, weight, moment and average once and writes each once, on `threads` threads. The arithmetic is
Paddle's own CPU AdamW, in its order and with its roundings: with AVX-512 its JIT kernel (`LDM_FMA`, the fused
multiply-adds of `phi/kernels/funcs/jit/gen/adamw.cc`), else its reference kernel (`jit/refer/refer.h`):

    p'  = p - decay_rate * p                          decoupled decay, decay_rate = (lr * lr_ratio) * coeff (0: none)
    m1' = beta1 * m1 + (1 - beta1) * g
    m2' = beta2 * m2 + (1 - beta2) * g * g            (the JIT kernel: (1 - beta2) * (g * g))
    p'' = p' + step * (m1' / (sqrt(m2') + eps))       step = -lr * (sqrt(1 - beta2^t) / (1 - beta1^t)),
                                                      eps = epsilon * sqrt(1 - beta2^t)
    ema' = ema + ema_weight * (p'' - ema)             Paddle's lerp_, ema_weight = 1 - decay, for each average

with g the gradient times `grad_scale` (the clip's factor, applied here instead of in a pass of its own). The
gradient is zeroed once read: the next backward accumulates into it, with no pass to clear it. Several averages (the
EMA and the post-hoc EMA's profiles) are each stepped over a run of CHUNK weights just written, while the run is in
the core's cache: the weights are read from memory once for all of them. */

#include <math.h>
#include <stdint.h>

#define CHUNK 4096

/* The sum of squares of each of `count` segments [starts[k], starts[k] + sizes[k]) of `x`, into `out[k]`: in
float over runs of CHUNK elements from the segment's start, in double over the runs. Each segment's sum depends on
its elements alone, not on where it lies in the buffer nor on the threads: the caller adds them up in the model's
order, so the global norm is the same bit for bit whatever the layout (sharded or not). */
void ldm_sum_squares(const float *x, const int64_t *starts, const int64_t *sizes, int64_t count, double *out,
                     int threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t k = 0; k < count; ++k) {
    const float *segment = x + starts[k];
    double total = 0.0;
    for (int64_t start = 0; start < sizes[k]; start += CHUNK) {
      const int64_t end = start + CHUNK < sizes[k] ? start + CHUNK : sizes[k];
      float part = 0.0f;
#pragma omp simd reduction(+ : part)
      for (int64_t i = start; i < end; ++i) part += segment[i] * segment[i];
      total += part;
    }
    out[k] = total;
  }
}

#ifdef LDM_FMA
#define MUL_ADD(a, b, c) fmaf((a), (b), (c))
#else
#define MUL_ADD(a, b, c) ((a) * (b) + (c))
#endif

static inline float adamw(float *p, float g, float *m1, float *m2, float decay_rate, float beta1, float beta2,
                          float one_minus_beta1, float one_minus_beta2, float step, float eps) {
#ifdef LDM_FMA
  const float decayed = fmaf(-decay_rate, *p, *p);
#else
  const float decayed = *p - decay_rate * *p;
#endif
  const float a = MUL_ADD(beta1, *m1, one_minus_beta1 * g);
#ifdef LDM_FMA
  const float b = fmaf(beta2, *m2, one_minus_beta2 * (g * g));
#else
  const float b = beta2 * *m2 + one_minus_beta2 * g * g;
#endif
  *m1 = a;
  *m2 = b;
  return MUL_ADD(step, a / (sqrtf(b) + eps), decayed);
}

/* `count` averages, averages[k] stepped with ema_weights[k] (count 0: AdamW alone). */
void ldm_adamw_ema(float *p, float *g, float *m1, float *m2, float *const *averages, const float *ema_weights,
                   int64_t count, int64_t n, float grad_scale, float decay_rate, float beta1, float beta2, float step,
                   float eps, int threads) {
  const float one_minus_beta1 = 1.0f - beta1, one_minus_beta2 = 1.0f - beta2;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t start = 0; start < n; start += CHUNK) {
    const int64_t end = start + CHUNK < n ? start + CHUNK : n;
#pragma omp simd
    for (int64_t i = start; i < end; ++i) {
      p[i] = adamw(p + i, g[i] * grad_scale, m1 + i, m2 + i, decay_rate, beta1, beta2, one_minus_beta1,
                   one_minus_beta2, step, eps);
      g[i] = 0.0f;
    }
    for (int64_t k = 0; k < count; ++k) {
      float *ema = averages[k];
      const float weight = ema_weights[k];
#pragma omp simd
      for (int64_t i = start; i < end; ++i) ema[i] = ema[i] + weight * (p[i] - ema[i]);
    }
  }
}

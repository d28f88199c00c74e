/*
 * attnres — fused Block Attention Residuals (Kimi team, arXiv:2603.15031).
 *
 * The C ABI that every front end (Python, C++, other languages) goes through.
 *
 * For every token t (tokens are independent) and every source i < L, where the
 * sources are the N completed blocks followed by the optional partial block:
 *
 *   r_i   = sqrt(mean_d(v_i[d]^2) + eps)          (rmsnorm on; r_i = 1 when off)
 *   z_i   = scale * dot(w, gamma * v_i / r_i)     (gamma taken as 1 when rmsnorm off)
 *   alpha = softmax_i(z)
 *   h     = sum_i alpha_i * v_i                   (values are the raw sources)
 *
 * Backward takes g = dLoss/dh and writes dLoss/dv_i for every source, dLoss/dw and
 * dLoss/dgamma (see docs/ or the reference in src/ref/ for the formulas).
 *
 * Memory layout. Every per-token tensor is a set of rows of `dim` contiguous
 * elements, one row per token, consecutive rows `*_row_stride` elements apart
 * (stride >= dim). A [B, T, D] tensor whose B and T dimensions collapse to one
 * stride (e.g. contiguous, or a slice x[..., :D] of a wider tensor) is read in
 * place. Blocks are passed as an array of N pointers: nothing is stacked or copied.
 * Caches are dense [num_tokens, L] arrays of the accumulation type (float for
 * f32/bf16/f16, double for f64). Pointers must be aligned to their element size;
 * on the CPU, rows that start on 64-byte lines (base pointers from
 * aligned_alloc(64, ...), as PyTorch allocates, and strides a multiple of 64
 * bytes) are fastest: large gradient rows are then written with non-temporal
 * stores (docs/PERFORMANCE.md measures the difference).
 *
 * Errors. Every call validates all of its arguments before touching any memory and
 * returns a status. On failure nothing is written to any output, and
 * attnres_last_error() (per thread) names the offending argument with the expected
 * and actual values.
 */
#ifndef ATTNRES_ATTNRES_H_
#define ATTNRES_ATTNRES_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define ATTNRES_API __declspec(dllexport)
#else
#define ATTNRES_API __attribute__((visibility("default")))
#endif

#define ATTNRES_VERSION_MAJOR 0
#define ATTNRES_VERSION_MINOR 1
#define ATTNRES_VERSION_PATCH 0
/* Bumped whenever attnres_params changes layout; checked by every call.
 * 2: the two-phase schedule's fields (num_queries onwards).
 * 3: phase 2's fused partial-block update (partial_update onwards). */
#define ATTNRES_ABI_VERSION 3

typedef enum attnres_status {
  ATTNRES_OK = 0,
  ATTNRES_ERROR_NULL_POINTER = 1,     /* a required pointer is NULL */
  ATTNRES_ERROR_INVALID_ARGUMENT = 2, /* a size, stride, flag or scalar is out of range */
  ATTNRES_ERROR_UNSUPPORTED_DTYPE = 3,
  ATTNRES_ERROR_OVERLAP = 4,          /* an output buffer overlaps an input or another output */
  ATTNRES_ERROR_OUT_OF_MEMORY = 5,    /* scratch memory could not be allocated */
  ATTNRES_ERROR_UNSUPPORTED_DEVICE = 6, /* the backend was not built or is not present */
  ATTNRES_ERROR_DEVICE_FAILURE = 7,    /* a device call or kernel launch failed */
  ATTNRES_ERROR_INTERNAL = 8           /* a bug in attnres: please report it */
} attnres_status;

typedef enum attnres_dtype {
  ATTNRES_DTYPE_FLOAT32 = 0,
  ATTNRES_DTYPE_FLOAT64 = 1,
  ATTNRES_DTYPE_BFLOAT16 = 2,
  ATTNRES_DTYPE_FLOAT16 = 3,
  ATTNRES_DTYPE_COUNT = 4 /* the number of dtypes, not a dtype */
} attnres_dtype;

typedef enum attnres_device {
  ATTNRES_DEVICE_CPU = 0,
  ATTNRES_DEVICE_CUDA = 1
} attnres_device;

/*
 * The one parameter block of every call. Fill it with attnres_params_init() first:
 * that sets the defaults (scale 1, eps 1e-6, rmsnorm on) and NULL for every pointer.
 *
 * Which fields each entry point reads. Every call checks abi_version, dtype,
 * device, num_tokens, dim, num_blocks, rmsnorm, scale and eps (and reads stream on
 * CUDA); a field not listed for an entry point is neither checked nor read by it.
 * "rows" are [num_tokens rows of dim] of the dtype at the stride named after
 * them; A is the accumulation type (float; double for float64); "opt." marks a
 * pointer that may be NULL (an output: not written; an input: as described).
 *
 *   attnres_forward, attnres_backward (L = num_blocks + (partial != NULL) >= 1)
 *     in   blocks[num_blocks], partial (opt.)   rows, source_row_stride
 *          proj_weight [dim], gamma (opt.) [dim] gamma is read only with rmsnorm
 *     fwd  out                                  rows, out_row_stride
 *          rms_cache (opt., only with rmsnorm), alpha_cache (opt.)
 *                                               outputs [num_tokens, L] of A
 *     bwd  grad_out                             rows, grad_out_row_stride
 *          rms_cache, alpha_cache (opt.)        inputs, as the forward wrote them
 *          grad_blocks (opt.; opt. entries), grad_partial (opt., only with partial)
 *                                               rows, grad_source_row_stride
 *          grad_proj_weight, grad_gamma (opt.)  [dim]; grad_gamma only with rmsnorm
 *
 *   attnres_phase1_forward, attnres_phase1_backward (num_blocks >= 1, S = num_queries)
 *     in   blocks[num_blocks]                   rows, source_row_stride
 *          partial                              must be NULL
 *          num_queries                          S in [1, 2^40]
 *          proj_weight [S, dim], gamma (opt.) [S, dim]   gamma read only with rmsnorm
 *     fwd  query_outs[S]                        rows, out_row_stride
 *          query_lses[S]                        [num_tokens] of A
 *     bwd  grad_query_outs[S] (opt. entries: zero)   rows, grad_out_row_stride
 *          grad_query_lses (opt.; opt. entries: zero)  [num_tokens] of A
 *          accumulate_grads                     1: grad_blocks are added into
 *          grad_blocks (opt.; opt. entries)     rows, grad_source_row_stride
 *          grad_proj_weight, grad_gamma (opt.)  [S, dim]; grad_gamma only with rmsnorm
 *          (query_outs and query_lses are not read: the backward recomputes them)
 *
 *   attnres_phase2_forward, attnres_phase2_backward (num_blocks must be 0)
 *     in   query_out                            rows (phase 1's o_s), source_row_stride
 *          partial (opt.)                       rows, source_row_stride (NULL: h = o)
 *          query_lse                            [num_tokens] of A; needed with partial
 *          proj_weight [dim], gamma (opt.) [dim]   proj_weight required; both read
 *                                               only with partial, gamma only with
 *                                               rmsnorm (scale and eps: with partial)
 *          input_norm, norm_eps, norm_weight (opt. [dim], only with input_norm)
 *     fwd  out                                  rows, out_row_stride
 *          partial_update (opt., needs partial) rows, source_row_stride
 *          new_partial (with partial_update)    rows, out_row_stride
 *     bwd  partial                              the forward's new_partial when it
 *                                               fused an update; partial_update must be NULL
 *          grad_out                             rows, grad_out_row_stride
 *          grad_partial_in (opt., needs grad_partial)   rows, grad_out_row_stride
 *          grad_query_out, grad_partial (opt.; grad_partial only with partial)
 *                                               rows, grad_source_row_stride
 *          grad_query_lse (opt.)                [num_tokens] of A
 *          grad_proj_weight, grad_gamma, grad_norm_weight (opt.)   [dim]; grad_gamma only
 *                                               with rmsnorm, grad_norm_weight with input_norm
 */
typedef struct attnres_params {
  int32_t abi_version;  /* ATTNRES_ABI_VERSION, set by attnres_params_init */

  /* Sizes. */
  int64_t num_tokens; /* B*T, >= 0 (0 is a valid no-op) */
  int64_t dim;        /* D, >= 1 */
  int64_t num_blocks; /* N, >= 0; L = N + (partial != NULL) must be >= 1 */
  /* int32_t rather than the enum types: a fixed size across compilers, and any
   * value a caller stores is well defined (and rejected if unknown). */
  int32_t dtype;         /* attnres_dtype of every source, w, gamma, out, grads */
  int32_t device;        /* attnres_device: where every pointer lives */
  void* stream;          /* cudaStream_t for ATTNRES_DEVICE_CUDA; ignored on the CPU */

  /* Inputs. */
  const void* const* blocks; /* N pointers to [num_tokens rows of dim] */
  const void* partial;       /* optional partial block, same layout, or NULL */
  int64_t source_row_stride; /* row stride of every block and of partial */
  const void* proj_weight;   /* w, [dim] (phase 1: [num_queries, dim]) */
  const void* gamma;         /* RMSNorm weight, like proj_weight; NULL means all ones */
  double scale;              /* finite */
  double eps;                /* >= 0 and finite */
  int32_t rmsnorm;           /* 1: normalise keys with RMSNorm, 0: keys are raw sources */

  /* Forward outputs. */
  void* out;              /* h, [num_tokens rows of dim] */
  int64_t out_row_stride;
  void* rms_cache;        /* optional [num_tokens, L]; only with rmsnorm */
  void* alpha_cache;      /* optional [num_tokens, L] softmax weights */

  /* Backward: upstream gradient and outputs. A NULL gradient pointer skips that
   * gradient (no write, no extra work beyond what the others need). */
  const void* grad_out;   /* dLoss/dh, [num_tokens rows of dim] */
  int64_t grad_out_row_stride;
  void* const* grad_blocks;      /* NULL, or N pointers each NULL or [rows of dim] */
  void* grad_partial;            /* optional */
  int64_t grad_source_row_stride;/* row stride of every grad_blocks[i] and grad_partial */
  void* grad_proj_weight;        /* optional [dim], overwritten */
  void* grad_gamma;              /* optional [dim], overwritten; only with rmsnorm */

  /* The two-phase schedule (ABI 2; docs/DESIGN.md, "The two phases"). Phase 1 mixes
   * the N completed blocks for S queries at once; phase 2 merges one query's result
   * with the partial block. Which of the fields above each phase reads, and how: the
   * table before this struct. The single op ignores the fields below. */
  int64_t num_queries;                /* S >= 1 (phase 1): proj_weight and gamma are [S, dim] */
  void* const* query_outs;            /* phase 1 forward: S pointers, o_s [rows of dim] (out_row_stride) */
  void* const* query_lses;            /* phase 1 forward: S pointers, lse_s [num_tokens] of the accumulation type */
  const void* const* grad_query_outs; /* phase 1 backward: S pointers (grad_out_row_stride); a NULL entry is zero */
  const void* const* grad_query_lses; /* phase 1 backward: NULL, or S pointers each NULL (zero) or [num_tokens] */
  int32_t accumulate_grads;           /* phase 1 backward: 1 adds into grad_blocks[i] instead of overwriting */
  const void* query_out;              /* phase 2: o_s [rows of dim] (source_row_stride) */
  const void* query_lse;              /* phase 2: lse_s [num_tokens] of the accumulation type */
  void* grad_query_out;               /* phase 2 backward: optional, [rows of dim] (grad_source_row_stride) */
  void* grad_query_lse;               /* phase 2 backward: optional, [num_tokens] of the accumulation type */
  int32_t input_norm;                 /* phase 2: 1 writes out = RMSNorm(h) * norm_weight instead of h */
  double norm_eps;                    /* that RMSNorm's eps: >= 0 and finite (default 1e-6) */
  const void* norm_weight;            /* [dim], or NULL for ones */
  void* grad_norm_weight;             /* phase 2 backward: optional [dim], overwritten; only with input_norm */

  /* Phase 2's fused partial-block update (ABI 3; docs/DESIGN.md). A model adds each
   * sub-layer's output y to the partial block before the next sub-layer reads it;
   * phase 2 can do that in the same pass: it forms p' = partial + partial_update
   * (each element rounded to the dtype, as a separate addition would), writes p' to
   * new_partial and merges p' in place of partial. Its backward needs only p' (pass
   * it as partial) and, through grad_partial_in, the gradient p' receives from its
   * other uses; grad_partial is then the gradient of both partial and y. */
  const void* partial_update;  /* phase 2 forward: optional y [rows of dim] (source_row_stride); needs partial */
  void* new_partial;           /* phase 2 forward: p' [rows of dim] (out_row_stride); required with partial_update */
  const void* grad_partial_in; /* phase 2 backward: optional [rows of dim] (grad_out_row_stride), added into grad_partial (needs it) */
} attnres_params;

/* The layout of attnres_params as this library was compiled: bindings that mirror
 * the struct (Python's ctypes) compare their offsets and sizes at load. */
typedef struct attnres_field {
  const char* name;
  int64_t offset;
  int64_t size;
} attnres_field;
/* The fields in declaration order; *count receives their number. */
ATTNRES_API const attnres_field* attnres_params_fields(int32_t* count);
ATTNRES_API int64_t attnres_params_size(void);

/* Library version "MAJOR.MINOR.PATCH". */
ATTNRES_API const char* attnres_version(void);

/* CPU kernel variants compiled into the library: "avx512bf16" (AVX-512 with native
 * bf16 narrowing), "avx512", "avx2" and "baseline" (any x86-64; the only one on
 * other architectures). The best one this CPU runs is
 * chosen at load; ATTNRES_CPU_ISA in the environment, or attnres_set_cpu_isa(),
 * forces another (tests and benchmarks run every one). NULL restores the automatic
 * choice. Fails with ATTNRES_ERROR_INVALID_ARGUMENT for a name that is unknown, not
 * compiled in, or not supported by this CPU. Not meant to be called while another
 * thread is inside attnres_forward/backward. */
ATTNRES_API const char* attnres_cpu_isa(void);
ATTNRES_API attnres_status attnres_set_cpu_isa(const char* name);
/* The variants this build compiled in and this CPU runs, best first, separated by
 * single spaces (e.g. "avx2 baseline"): the names attnres_set_cpu_isa() accepts. */
ATTNRES_API const char* attnres_cpu_isas(void);

/* Defaults: abi_version, scale = 1, eps = 1e-6, rmsnorm = 1, CPU, num_queries = 1,
 * norm_eps = 1e-6, everything else 0. */
ATTNRES_API void attnres_params_init(attnres_params* params);

/* Forward: writes out, and rms_cache / alpha_cache when they are non-NULL. */
ATTNRES_API attnres_status attnres_forward(const attnres_params* params);

/* Backward: writes every non-NULL gradient pointer. Uses rms_cache / alpha_cache
 * when given (as written by attnres_forward with the same inputs), recomputes
 * them otherwise. dw and dgamma are bitwise reproducible for any thread count. */
ATTNRES_API attnres_status attnres_backward(const attnres_params* params);

/*
 * The two-phase schedule, per token (r_i = 1 without rmsnorm, u_s = w_s * gamma_s):
 *   phase 1  z_{s,i} = scale * dot(u_s, v_i) / r_i over the N blocks (partial must be NULL)
 *            lse_s = log sum_i exp(z_{s,i}),  o_s = sum_i exp(z_{s,i} - lse_s) v_i
 *   phase 2  z_p = scale * dot(u, p) / r_p,  beta = sigmoid(lse - z_p)
 *            h = beta * o + (1 - beta) * p   (h = o when partial is NULL)
 *            out = h, or RMSNorm(h) * norm_weight with input_norm
 *            with partial_update: p = partial + partial_update, also written to new_partial
 * Phase 1's backward recomputes the logits from the blocks (it needs neither o_s
 * nor lse_s), reads each block once and writes each block's gradient once; dw and
 * dgamma ([S, dim]) are bitwise reproducible for any thread count, as are phase 2's
 * dw, dgamma and dnorm_weight.
 */
ATTNRES_API attnres_status attnres_phase1_forward(const attnres_params* params);
ATTNRES_API attnres_status attnres_phase1_backward(const attnres_params* params);
ATTNRES_API attnres_status attnres_phase2_forward(const attnres_params* params);
ATTNRES_API attnres_status attnres_phase2_backward(const attnres_params* params);

/* The message of the last failed call on this thread ("" if none). */
ATTNRES_API const char* attnres_last_error(void);

/* Human-readable name of a status code. */
ATTNRES_API const char* attnres_status_string(attnres_status status);

/* CPU threads. The default is the number of cores, overridden by the environment
 * variable ATTNRES_NUM_THREADS, then OMP_NUM_THREADS. n <= 0 restores the default. */
ATTNRES_API void attnres_set_num_threads(int n);
ATTNRES_API int attnres_get_num_threads(void);

/* 1 if the library was built with the CUDA backend and a device is present. */
ATTNRES_API int attnres_cuda_available(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ATTNRES_ATTNRES_H_ */

/* Updaters: the arithmetic of a push, one loop per (updater, dtype).
 *
 * Called with the covered values owned by the caller (stripe or row lock held, or
 * hogwild).  Formulas follow torch.optim's defaults (docs/updaters.md writes each
 * out) and McMahan et al. 2013 for FTRL.  float16 values are computed in float32;
 * state arrays are float32 (float64 for float64 tensors).  Integer sums wrap modulo
 * 2^bits, as numpy's do.
 *
 * params[] by updater:
 *   SGD      lr, weight_decay
 *   MOMENTUM lr, momentum, dampening, nesterov, weight_decay
 *   ADAGRAD  lr, lr_decay, weight_decay, initial_accumulator_value, eps
 *   ADAM     lr, beta1, beta2, eps, weight_decay, amsgrad
 *   FTRL     alpha, beta, l1, l2
 */
#include "internal.h"
#include <math.h>

#define FLOAT_KERNELS(SUF, T, C, SQRT)                                                 \
static void k_sum_##SUF(T *restrict w, const C *restrict g, uint64_t n) {             \
    for (uint64_t i = 0; i < n; i++) w[i] = (T)((C)w[i] + g[i]);                     \
}                                                                                     \
static void k_assign_##SUF(T *restrict w, const C *restrict g, uint64_t n) {          \
    for (uint64_t i = 0; i < n; i++) w[i] = (T)g[i];                                  \
}                                                                                     \
static void k_max_##SUF(T *restrict w, const C *restrict g, uint64_t n) {             \
    for (uint64_t i = 0; i < n; i++) { C a = (C)w[i]; w[i] = (T)(g[i] > a ? g[i] : a); } \
}                                                                                     \
static void k_min_##SUF(T *restrict w, const C *restrict g, uint64_t n) {             \
    for (uint64_t i = 0; i < n; i++) { C a = (C)w[i]; w[i] = (T)(g[i] < a ? g[i] : a); } \
}                                                                                     \
static void k_sgd_##SUF(T *restrict w, const C *restrict g, uint64_t n, C lr, C wd) { \
    if (wd == 0) {                                                                    \
        for (uint64_t i = 0; i < n; i++) w[i] = (T)((C)w[i] - lr * g[i]);             \
    } else {                                                                          \
        for (uint64_t i = 0; i < n; i++) { C p = (C)w[i]; w[i] = (T)(p - lr * (g[i] + wd * p)); } \
    }                                                                                 \
}                                                                                     \
static void k_momentum_##SUF(T *restrict w, const C *restrict g, C *restrict buf,     \
                             uint64_t n, C lr, C mu, C damp, int nesterov, C wd,       \
                             int first) {                                             \
    for (uint64_t i = 0; i < n; i++) {                                                \
        C p = (C)w[i], d = g[i] + wd * p;                                             \
        C b = first ? d : mu * buf[i] + (1 - damp) * d;                               \
        buf[i] = b;                                                                   \
        w[i] = (T)(p - lr * (nesterov ? d + mu * b : b));                             \
    }                                                                                 \
}                                                                                     \
static void k_adagrad_##SUF(T *restrict w, const C *restrict g, C *restrict acc,      \
                            uint64_t n, C clr, C wd, C eps) {                          \
    for (uint64_t i = 0; i < n; i++) {                                                \
        C p = (C)w[i], d = g[i] + wd * p;                                             \
        C s = acc[i] + d * d;                                                         \
        acc[i] = s;                                                                   \
        w[i] = (T)(p - clr * d / (SQRT(s) + eps));                                    \
    }                                                                                 \
}                                                                                     \
static void k_adam_##SUF(T *restrict w, const C *restrict g, C *restrict m,           \
                         C *restrict v, C *restrict vmax, uint64_t n, C step_size,    \
                         C b1, C b2, C eps, C wd, C bc2_sqrt) {                       \
    for (uint64_t i = 0; i < n; i++) {                                                \
        C p = (C)w[i], d = g[i] + wd * p;                                             \
        C mi = m[i] + (1 - b1) * (d - m[i]);  /* torch: exp_avg.lerp_(grad, 1-b1) */  \
        C vi = b2 * v[i] + (1 - b2) * d * d;                                          \
        m[i] = mi; v[i] = vi;                                                         \
        if (vmax) { if (vmax[i] > vi) vi = vmax[i]; vmax[i] = vi; }                   \
        w[i] = (T)(p - step_size * mi / (SQRT(vi) / bc2_sqrt + eps));                 \
    }                                                                                 \
}                                                                                     \
static void k_ftrl_##SUF(T *restrict w, const C *restrict g, C *restrict z,           \
                         C *restrict nacc, uint64_t n, C alpha, C beta, C l1, C l2) {  \
    for (uint64_t i = 0; i < n; i++) {                                                \
        C gi = g[i], ni = nacc[i], nn = ni + gi * gi;                                 \
        C sigma = (SQRT(nn) - SQRT(ni)) / alpha;                                      \
        C zi = z[i] + gi - sigma * (C)w[i];                                           \
        z[i] = zi; nacc[i] = nn;                                                      \
        C az = zi < 0 ? -zi : zi;                                                     \
        w[i] = az <= l1 ? (T)0 : (T)(-(zi - (zi < 0 ? -l1 : l1)) / ((beta + SQRT(nn)) / alpha + l2)); \
    }                                                                                 \
}

FLOAT_KERNELS(f16, _Float16, float, sqrtf)
FLOAT_KERNELS(f32, float, float, sqrtf)
FLOAT_KERNELS(f64, double, double, sqrt)

/* Integer reductions; sums go through the unsigned type so overflow wraps. */
#define INT_KERNELS(SUF, T, U)                                                        \
static void k_sum_##SUF(T *restrict w, const T *restrict g, uint64_t n) {             \
    for (uint64_t i = 0; i < n; i++) w[i] = (T)((U)w[i] + (U)g[i]);                   \
}                                                                                     \
static void k_assign_##SUF(T *restrict w, const T *restrict g, uint64_t n) {          \
    for (uint64_t i = 0; i < n; i++) w[i] = g[i];                                     \
}                                                                                     \
static void k_max_##SUF(T *restrict w, const T *restrict g, uint64_t n) {             \
    for (uint64_t i = 0; i < n; i++) w[i] = g[i] > w[i] ? g[i] : w[i];                \
}                                                                                     \
static void k_min_##SUF(T *restrict w, const T *restrict g, uint64_t n) {             \
    for (uint64_t i = 0; i < n; i++) w[i] = g[i] < w[i] ? g[i] : w[i];                \
}
INT_KERNELS(i8, int8_t, uint8_t)
INT_KERNELS(i32, int32_t, uint32_t)

#define DISPATCH_FLOAT(SUF, T, C)                                                     \
    {                                                                                 \
        T *w = (T *)wv;                                                               \
        const C *g = (const C *)gv;                                                   \
        C *s0 = (C *)st[0], *s1 = (C *)st[1], *s2 = (C *)st[2];                       \
        (void)s0; (void)s1; (void)s2;                                                 \
        switch (s->updater) {                                                         \
        case SHMPS_SUM: k_sum_##SUF(w, g, n); break;                                  \
        case SHMPS_ASSIGN: k_assign_##SUF(w, g, n); break;                            \
        case SHMPS_MAX: k_max_##SUF(w, g, n); break;                                  \
        case SHMPS_MIN: k_min_##SUF(w, g, n); break;                                  \
        case SHMPS_SGD: k_sgd_##SUF(w, g, n, (C)p[0], (C)p[1]); break;                \
        case SHMPS_MOMENTUM:                                                          \
            k_momentum_##SUF(w, g, s0, n, (C)p[0], (C)p[1], (C)p[2], p[3] != 0,       \
                             (C)p[4], step <= 1);                                     \
            break;                                                                    \
        case SHMPS_ADAGRAD:                                                           \
            k_adagrad_##SUF(w, g, s0, n, (C)(p[0] / (1 + (double)(step - 1) * p[1])), \
                            (C)p[2], (C)p[4]);                                        \
            break;                                                                    \
        case SHMPS_ADAM: {                                                            \
            double bc1 = 1 - pow(p[1], (double)step), bc2 = 1 - pow(p[2], (double)step); \
            k_adam_##SUF(w, g, s0, s1, p[5] != 0 ? s2 : NULL, n, (C)(p[0] / bc1),     \
                         (C)p[1], (C)p[2], (C)p[3], (C)p[4], (C)sqrt(bc2));           \
            break;                                                                    \
        }                                                                             \
        case SHMPS_FTRL:                                                              \
            k_ftrl_##SUF(w, g, s0, s1, n, (C)p[0], (C)p[1], (C)p[2], (C)p[3]);        \
            break;                                                                    \
        default: return SHMPS_E_ARG;                                                  \
        }                                                                             \
        return SHMPS_OK;                                                              \
    }

#define DISPATCH_INT(SUF, T)                                                          \
    {                                                                                 \
        T *w = (T *)wv;                                                               \
        const T *g = (const T *)gv;                                                   \
        switch (s->updater) {                                                         \
        case SHMPS_SUM: k_sum_##SUF(w, g, n); break;                                  \
        case SHMPS_ASSIGN: k_assign_##SUF(w, g, n); break;                            \
        case SHMPS_MAX: k_max_##SUF(w, g, n); break;                                  \
        case SHMPS_MIN: k_min_##SUF(w, g, n); break;                                  \
        default: return SHMPS_E_ARG;                                                  \
        }                                                                             \
        return SHMPS_OK;                                                              \
    }

int shmps_apply(void *base, const shmps_spec_t *s, uint64_t i0, uint64_t n, const void *gv,
                uint64_t step) {
    if (i0 > s->nnz || n > s->nnz - i0) return SHMPS_E_BOUNDS;
    if (step == 0) step = 1;
    const double *p = s->params;
    void *wv = at(base, s->value_off + i0 * s->itemsize);
    void *st[SHMPS_MAX_STATE] = {0};
    for (uint32_t k = 0; k < s->nstate && k < SHMPS_MAX_STATE; k++)
        st[k] = at(base, s->state_off[k] + i0 * s->state_itemsize);
    switch (s->dtype) {
    case SHMPS_FLOAT16: DISPATCH_FLOAT(f16, _Float16, float)
    case SHMPS_FLOAT32: DISPATCH_FLOAT(f32, float, float)
    case SHMPS_FLOAT64: DISPATCH_FLOAT(f64, double, double)
    case SHMPS_INT8: DISPATCH_INT(i8, int8_t)
    case SHMPS_INT32: DISPATCH_INT(i32, int32_t)
    default: return SHMPS_E_ARG;
    }
}

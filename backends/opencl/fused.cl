// Row-per-work-item GEMV family for decode (T = 1) on CPU OpenCL devices (PoCL), with
// the fusions the lazy op graph of backend.py finds:
//   * up to three weights that read the same input in one launch (q/k/v),
//   * the RMSNorm of the input computed in the prologue (input_layernorm -> q/k/v,
//     post_attention_layernorm -> gate/up, the final norm -> lm_head),
//   * gate/up + GLU in one launch (each item computes row n of both, writes act(g) * u),
//   * the residual add in the epilogue (o_proj, down_proj).
// (RoPE of q and k fused with the KV-cache write is attention.cl's rope_kv_write.)
// gemm_rows is the same row kernel with a token loop, for prefill on CPU devices.
//
// Why one row per work-item: PoCL runs a work-group as a loop over its items on one core;
// a row per item needs no barrier in the main loop and each item streams one contiguous
// row while the (normalized) input sits in local memory (L1 on a CPU). RLWS (caps.rlws,
// 16) items per group: 8 was slower, 16 / 32 / 64 alike within noise (decode tok/s, A/B).
//
// Why no OpenCL builtins in the loops (vloadN, fma, dot, convert_*, min, vload_half):
// PoCL's binary distribution links its kernel library as calls that are not inlined, so
// every builtin in an inner loop is a function call with spills (5-7x slower GEMV,
// measured). The loops use vector-pointer loads, * and +, and the exact "magic number"
// int->float conversion as_float(0x4B000000 | q) - 2^23 = q for 0 <= q < 2^23.
//
// Variant (build option) WFMT: 0 dense f32 (codes float [N, stride], stride % 8 == 0),
// 1 INT4 (codes uint [N, stride] words of 8 nibbles, low first), 2 INT8 (codes char
// [N, stride], stride % 8 == 0). Scales are float32 [N, NG] (repacked at upload), zeros
// uchar [N, NG] (INT4 asymmetric) or absent (INT4: z = 8, INT8: 0). KMAX: the most input
// features the local staging buffer holds (the host checks).

#define MAGIC 0x4B000000u
#define MAGIC_F 8388608.0f

#define F_ZEROS 1       // INT4 zero points present
#define F_NORM 2        // RMSNorm of x in the prologue (normw, eps)
#define F_NORM_OFF 4    // ... scaled by (1 + w)
#define F_RES 8         // y0 += res (single weight)
#define F_GLU 16        // y0 = act(W0 x + b0) * (W1 x + b1)
#define F_GELU 32       // act = gelu_tanh (else silu)
#define F_BIAS0 64
#define F_BIAS1 128
#define F_BIAS2 256

#if WFMT == 0
#define WCODE_T float
#elif WFMT == 1
#define WCODE_T uint
#else
#define WCODE_T char
#endif

// dot(W[n, :], xs) for one row; xs staged (zero beyond K) in local memory.
inline float row_dot(__global const WCODE_T* W, __global const float* S,
                     __global const uchar* Z, int n, __local const float8* xs8,
                     int nw, int stride, int NG, int wpg, int has_zeros)
{
#if WFMT == 0
    __global const float8* r = (__global const float8*)(W + (size_t)n * stride);
    float8 a0 = (float8)(0.0f), a1 = (float8)(0.0f);
    int w = 0;
    for (; w + 1 < nw; w += 2) {
        a0 += r[w] * xs8[w];
        a1 += r[w + 1] * xs8[w + 1];
    }
    if (w < nw) a0 += r[w] * xs8[w];
    a0 += a1;
    const float4 s4 = a0.lo + a0.hi;
    return (s4.x + s4.y) + (s4.z + s4.w);
#elif WFMT == 1
    // nw = words holding columns < K; wpg = words per group (nw when NG == 1).
    __global const uint* r = W + (size_t)n * stride;
    float acc = 0.0f;
    const uint8 sh = (uint8)(0, 4, 8, 12, 16, 20, 24, 28);
    for (int g = 0; g < NG; g++) {
        float8 a0 = (float8)(0.0f), a1 = (float8)(0.0f);
        const float zb = (has_zeros ? (float)Z[n * NG + g] : (float)SYMMETRIC_ZERO_4BIT) + MAGIC_F;
        int we = (g + 1) * wpg;
        we = we < nw ? we : nw;
        int w = g * wpg;
        for (; w + 1 < we; w += 2) {
            const uint q0 = r[w], q1 = r[w + 1];
            a0 += (as_float8((((uint8)(q0) >> sh) & 15u) | MAGIC) - zb) * xs8[w];
            a1 += (as_float8((((uint8)(q1) >> sh) & 15u) | MAGIC) - zb) * xs8[w + 1];
        }
        if (w < we) a0 += (as_float8((((uint8)(r[w]) >> sh) & 15u) | MAGIC) - zb) * xs8[w];
        a0 += a1;
        const float4 s4 = a0.lo + a0.hi;
        acc += S[n * NG + g] * ((s4.x + s4.y) + (s4.z + s4.w));
    }
    return acc;
#else
    // INT8: a char8 load; the element-wise (float) casts of a vector literal compile to
    // one sign-extend + one int->float conversion (convert_float8 would be a call)
    __global const char8* r = (__global const char8*)(W + (size_t)n * stride);
    float acc = 0.0f;
    for (int g = 0; g < NG; g++) {
        float8 a0 = (float8)(0.0f), a1 = (float8)(0.0f);
        int we = (g + 1) * wpg;
        we = we < nw ? we : nw;
        int w = g * wpg;
        for (; w + 1 < we; w += 2) {
            const char8 c = r[w], d = r[w + 1];
            a0 += (float8)((float)c.s0, (float)c.s1, (float)c.s2, (float)c.s3, (float)c.s4,
                           (float)c.s5, (float)c.s6, (float)c.s7) * xs8[w];
            a1 += (float8)((float)d.s0, (float)d.s1, (float)d.s2, (float)d.s3, (float)d.s4,
                           (float)d.s5, (float)d.s6, (float)d.s7) * xs8[w + 1];
        }
        if (w < we) {
            const char8 c = r[w];
            a0 += (float8)((float)c.s0, (float)c.s1, (float)c.s2, (float)c.s3, (float)c.s4,
                           (float)c.s5, (float)c.s6, (float)c.s7) * xs8[w];
        }
        a0 += a1;
        const float4 s4 = a0.lo + a0.hi;
        acc += S[n * NG + g] * ((s4.x + s4.y) + (s4.z + s4.w));
    }
    return acc;
#endif
}

// Rows: segment 0 (N0 rows of W0 -> y0), then N1 of W1 -> y1, then N2 of W2 -> y2; with
// F_GLU only N0 rows (W1 has N0 rows too). Global size: rows rounded up to RLWS.
// K: input features; KW: 8-column words of the staged input (ceil(K / 8));
// nw, wpg: words per row to read / per group (see row_dot).
__kernel __attribute__((reqd_work_group_size(RLWS, 1, 1)))
void gemv_rows(__global float* y0, __global float* y1, __global float* y2,
               __global const float* x, __global const float* normw, __global const float* res,
               __global const WCODE_T* W0, __global const float* S0, __global const uchar* Z0,
               __global const float* B0,
               __global const WCODE_T* W1, __global const float* S1, __global const uchar* Z1,
               __global const float* B1,
               __global const WCODE_T* W2, __global const float* S2, __global const uchar* Z2,
               __global const float* B2,
               int N0, int N1, int N2, int K, int KW, int stride, int NG, int wpg, int flags,
               float eps)
{
    __local float8 xs8[KMAX / 8];
    __local float red[RLWS];
    __local float* xs = (__local float*)xs8;
    const int lid = get_local_id(0);
    float inv = 1.0f;
    if (flags & F_NORM) {
        float ss = 0.0f;
        for (int i = lid; i < K; i += RLWS) ss += x[i] * x[i];
        red[lid] = ss;
        barrier(CLK_LOCAL_MEM_FENCE);
        ss = 0.0f;
        for (int i = 0; i < RLWS; i++) ss += red[i];
        inv = 1.0f / sqrt(ss / (float)K + eps);      // same op order as rmsnorm()
    }
    for (int i = lid; i < 8 * KW; i += RLWS) {
        float v = 0.0f;
        if (i < K) {
            v = x[i];
            if (flags & F_NORM) v = v * inv * ((flags & F_NORM_OFF) ? 1.0f + normw[i] : normw[i]);
        }
        xs[i] = v;
    }
    barrier(CLK_LOCAL_MEM_FENCE);

    int n = get_global_id(0);
    const int hz = flags & F_ZEROS;
    if (flags & F_GLU) {
        if (n >= N0) return;
        float g = row_dot(W0, S0, Z0, n, xs8, KW, stride, NG, wpg, hz);
        float u = row_dot(W1, S1, Z1, n, xs8, KW, stride, NG, wpg, hz);
        if (flags & F_BIAS0) g += B0[n];
        if (flags & F_BIAS1) u += B1[n];
        float a;
        if (flags & F_GELU) a = 0.5f * g * (1.0f + tanh(0.7978845608028654f * (g + 0.044715f * g * g * g)));
        else a = g / (1.0f + exp(-g));
        y0[n] = a * u;
        return;
    }
    if (n < N0) {
        float v = row_dot(W0, S0, Z0, n, xs8, KW, stride, NG, wpg, hz);
        if (flags & F_BIAS0) v += B0[n];
        if (flags & F_RES) v += res[n];
        y0[n] = v;
        return;
    }
    n -= N0;
    if (n < N1) {
        float v = row_dot(W1, S1, Z1, n, xs8, KW, stride, NG, wpg, hz);
        if (flags & F_BIAS1) v += B1[n];
        y1[n] = v;
        return;
    }
    n -= N1;
    if (n < N2) {
        float v = row_dot(W2, S2, Z2, n, xs8, KW, stride, NG, wpg, hz);
        if (flags & F_BIAS2) v += B2[n];
        y2[n] = v;
    }
}

// Y[T, N] = X[T, K] @ W[N, K]^T (+ bias) for prefill (T > 1) on CPU devices: the same row
// kernel with a token loop. Blocks of TB = KMAX / (8 * KW) tokens (at most 16) are staged
// in local memory; each item keeps its weight row hot in L1 across the block's tokens.
// flags: F_ZEROS, F_BIAS0 (other bits ignored).
__kernel __attribute__((reqd_work_group_size(RLWS, 1, 1)))
void gemm_rows(__global float* Y, __global const float* X, __global const WCODE_T* W,
               __global const float* S, __global const uchar* Z, __global const float* B,
               int T, int N, int K, int KW, int stride, int NG, int wpg, int flags)
{
    __local float8 xs8[KMAX / 8];
    __local float* xs = (__local float*)xs8;
    const int lid = get_local_id(0), n = get_global_id(0);
    int tb = KMAX / (8 * KW);
    tb = tb < 16 ? tb : 16;
    const int hz = flags & F_ZEROS;
    const float b = (n < N && (flags & F_BIAS0)) ? B[n] : 0.0f;
    for (int t0 = 0; t0 < T; t0 += tb) {
        const int nt = T - t0 < tb ? T - t0 : tb;
        barrier(CLK_LOCAL_MEM_FENCE);              // the previous block is consumed
        for (int i = lid; i < nt * 8 * KW; i += RLWS) {
            const int tt = i / (8 * KW), k = i - tt * 8 * KW;
            xs[i] = k < K ? X[(size_t)(t0 + tt) * K + k] : 0.0f;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        if (n < N) {
            for (int tt = 0; tt < nt; tt++)
                Y[(size_t)(t0 + tt) * N + n] = row_dot(W, S, Z, n, xs8 + tt * KW, KW, stride, NG, wpg, hz) + b;
        }
    }
}

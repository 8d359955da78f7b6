// Float32 kernels: dense GEMV, dense embedding, RMSNorm, RoPE, GLU, add.
// Output first, then inputs, then sizes (same order as the Numba backend).

// y[N] = W[N, K] @ x[K] (+ bias[N]); W float32 rows padded to KP (>= K) columns.
// One work-group of LWS items per block of ROWS rows; items stride over float4 columns
// (consecutive items read consecutive float4: coalesced); local-memory tree reduction.
__kernel __attribute__((reqd_work_group_size(LWS, 1, 1)))
void gemv_f32(__global float* y, __global const float* x, __global const float* W,
              __global const float* bias, int N, int K, int KP, int has_bias)
{
    __local float red[LWS];
    const int lid = get_local_id(0);
    const int row0 = get_group_id(0) * ROWS;
    float acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = 0.0f;
    // Only the float4s that hold x's K values: x has no padding, and reading past its end
    // (the padded W columns are zero, but 0 * NaN garbage is NaN) corrupts the row.
    for (int c = lid; c < (K + 3) / 4; c += LWS) {
        const int k = 4 * c;
        float4 xv = (float4)(0.0f);
        if (k + 4 <= K) {
            xv = vload4(c, x);
        } else {            // the last, partial float4 of x (k < K always holds here)
            xv.s0 = x[k];
            if (k + 1 < K) xv.s1 = x[k + 1];
            if (k + 2 < K) xv.s2 = x[k + 2];
        }
        for (int r = 0; r < ROWS; r++) {
            const int n = row0 + r;
            if (n < N) acc[r] += dot(vload4(c, W + (size_t)n * KP), xv);
        }
    }
    for (int r = 0; r < ROWS; r++) {
        const float s = wg_sum(acc[r], red);
        const int n = row0 + r;
        if (lid == 0 && n < N) y[n] = s + (has_bias ? bias[n] : 0.0f);
    }
}

// y[T, D] = W[ids[t], :D] * scale; W float32 [V, KP]. Global (D, T).
__kernel void embed_f32(__global float* y, __global const int* ids, __global const float* W,
                        int D, int KP, float scale)
{
    const int d = get_global_id(0), t = get_global_id(1);
    if (d < D) y[t * D + d] = W[(size_t)ids[t] * KP + d] * scale;
}

// y[R, N] = x[R, N] * rsqrt(mean(x^2) + eps) * (w or 1 + w); R rows (T, or T*H for
// per-head QK-norm). One work-group per row; the mean is accumulated in float32.
__kernel __attribute__((reqd_work_group_size(LWS, 1, 1)))
void rmsnorm(__global float* y, __global const float* x, __global const float* w,
             int N, float eps, int unit_offset)
{
    __local float red[LWS];
    const int row = get_group_id(0), lid = get_local_id(0);
    __global const float* xr = x + (size_t)row * N;
    float ss = 0.0f;
    for (int i = lid; i < N; i += LWS) ss += xr[i] * xr[i];
    ss = wg_sum(ss, red);
    const float inv = 1.0f / sqrt(ss / (float)N + eps);   // same op order as the reference
    for (int i = lid; i < N; i += LWS) {
        const float g = unit_offset ? 1.0f + w[i] : w[i];
        y[(size_t)row * N + i] = xr[i] * inv * g;
    }
}

// y[T, H, hd] = rope(x[T, H, hd]): NeoX rotate-half pairs (i, i + r2) for i < r2, dims
// >= 2*r2 copied (partial rotary). cos/sin [max_pos, r2]; position of token t is
// pos[t] if use_pos else pos0 + t (the common contiguous case needs no upload).
__kernel void rope(__global float* y, __global const float* x, __global const float* cosv,
                   __global const float* sinv, __global const int* pos, int pos0, int use_pos,
                   int H, int hd, int r2, int total)
{
    const int idx = get_global_id(0);
    if (idx >= total) return;
    const int d = idx % hd;
    const int t = idx / (H * hd);
    const int base = idx - d;                       // start of this (t, h) vector
    const int p = use_pos ? pos[t] : pos0 + t;
    if (d < r2) {
        const float c = cosv[p * r2 + d], s = sinv[p * r2 + d];
        y[idx] = x[base + d] * c - x[base + d + r2] * s;
    } else if (d < 2 * r2) {
        const int i = d - r2;
        const float c = cosv[p * r2 + i], s = sinv[p * r2 + i];
        y[idx] = x[base + d] * c + x[base + i] * s;
    } else {
        y[idx] = x[idx];
    }
}

// y[n] = act(g[n]) * u[n]; act 0 = silu, 1 = gelu_tanh (the tanh approximation).
__kernel void glu(__global float* y, __global const float* g, __global const float* u,
                  int n, int act)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    const float x = g[i];
    float a;
    if (act == 0) {
        a = x / (1.0f + exp(-x));                   // -> -0 for x << 0, never NaN
    } else {
        a = 0.5f * x * (1.0f + tanh(0.7978845608028654f * (x + 0.044715f * x * x * x)));
    }
    y[i] = a * u[i];
}

// y[n] = a[n] + b[n]
__kernel void add(__global float* y, __global const float* a, __global const float* b, int n)
{
    const int i = get_global_id(0);
    if (i < n) y[i] = a[i] + b[i];
}

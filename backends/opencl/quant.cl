// Quantized kernels: INT4 / INT8 GEMV (decode, T = 1) and quantized embedding rows.
// Variant: SCALE_HALF (fp16 scales read with vload_half) or float32 scales.

// y[N] = W[N, K] @ x[K] (+ bias[N]); W INT4: codes uint32 [N, WPR], scales [N, NG],
// zeros uchar [N, NG] (has_zeros) or symmetric z = SYMMETRIC_ZERO_4BIT; w = (q - z) * s.
// Each word holds 8 consecutive columns of one group (needs G % 8 == 0 or NG == 1, the
// host checks), so per word: s * (sum q*x - z * sum x). One work-group per ROWS rows,
// items stride over words (coalesced), local-memory tree reduction.
__kernel __attribute__((reqd_work_group_size(LWS, 1, 1)))
void gemv_q4(__global float* y, __global const float* x, __global const uint* codes,
             __global const SCALE_T* scales, __global const uchar* zeros,
             __global const float* bias, int N, int K, int WPR, int NG, int G,
             int has_zeros, int has_bias)
{
    __local float red[LWS];
    const int lid = get_local_id(0);
    const int row0 = get_group_id(0) * ROWS;
    float acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = 0.0f;
    for (int w = lid; w < WPR; w += LWS) {
        const int k0 = w * NIBBLES_PER_WORD;
        if (k0 >= K) break;                         // padded columns: x is 0 there
        float8 xv = (float8)(0.0f);
        if (k0 + 8 <= K) {
            xv = vload8(w, x);
        } else {
            float xs[8];
            for (int i = 0; i < 8; i++) xs[i] = (k0 + i < K) ? x[k0 + i] : 0.0f;
            xv = vload8(0, xs);
        }
        const float sx = xv.s0 + xv.s1 + xv.s2 + xv.s3 + xv.s4 + xv.s5 + xv.s6 + xv.s7;
        const int g = (NG == 1) ? 0 : k0 / G;
        for (int r = 0; r < ROWS; r++) {
            const int n = row0 + r;
            if (n >= N) break;
            const uint q = codes[(size_t)n * WPR + w];
            const float8 qv = convert_float8((uint8)(q, q >> 4, q >> 8, q >> 12,
                                                     q >> 16, q >> 20, q >> 24, q >> 28) & 15u);
            const float dq = dot(qv.lo, xv.lo) + dot(qv.hi, xv.hi);
            const float z = has_zeros ? (float)zeros[n * NG + g] : (float)SYMMETRIC_ZERO_4BIT;
            acc[r] += LOAD_SCALE(scales, n * NG + g) * (dq - z * sx);
        }
    }
    for (int r = 0; r < ROWS; r++) {
        const float s = wg_sum(acc[r], red);
        const int n = row0 + r;
        if (lid == 0 && n < N) y[n] = s + (has_bias ? bias[n] : 0.0f);
    }
}

// y[N] = W[N, K] @ x[K] (+ bias[N]); W INT8 symmetric: codes char [N, KP], scales [N, NG],
// w = q * s. Items read char4 words (needs G % 4 == 0 or NG == 1).
__kernel __attribute__((reqd_work_group_size(LWS, 1, 1)))
void gemv_q8(__global float* y, __global const float* x, __global const char* codes,
             __global const SCALE_T* scales, __global const float* bias,
             int N, int K, int KP, int NG, int G, int has_bias)
{
    __local float red[LWS];
    const int lid = get_local_id(0);
    const int row0 = get_group_id(0) * ROWS;
    float acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = 0.0f;
    for (int c = lid; c < KP / 4; c += LWS) {
        const int k = 4 * c;
        if (k >= K) break;
        float4 xv = (float4)(0.0f);
        if (k + 4 <= K) {
            xv = vload4(c, x);
        } else {
            xv.s0 = x[k];
            if (k + 1 < K) xv.s1 = x[k + 1];
            if (k + 2 < K) xv.s2 = x[k + 2];
        }
        const int g = (NG == 1) ? 0 : k / G;
        for (int r = 0; r < ROWS; r++) {
            const int n = row0 + r;
            if (n >= N) break;
            const float4 qv = convert_float4(vload4(c, codes + (size_t)n * KP));
            acc[r] += LOAD_SCALE(scales, n * NG + g) * dot(qv, xv);
        }
    }
    for (int r = 0; r < ROWS; r++) {
        const float s = wg_sum(acc[r], red);
        const int n = row0 + r;
        if (lid == 0 && n < N) y[n] = s + (has_bias ? bias[n] : 0.0f);
    }
}

// y[T, D] = dequant(W)[ids[t], :D] * scale for an INT4 table (layout as gemv_q4). Global (D, T).
__kernel void embed_q4(__global float* y, __global const int* ids, __global const uint* codes,
                       __global const SCALE_T* scales, __global const uchar* zeros,
                       int D, int WPR, int NG, int G, int has_zeros, float scale)
{
    const int d = get_global_id(0), t = get_global_id(1);
    if (d < D) y[t * D + d] = dequant_q4(codes, scales, zeros, WPR, NG, G, has_zeros, ids[t], d) * scale;
}

// y[T, D] = dequant(W)[ids[t], :D] * scale for an INT8 table (layout as gemv_q8). Global (D, T).
__kernel void embed_q8(__global float* y, __global const int* ids, __global const char* codes,
                       __global const SCALE_T* scales, int D, int KP, int NG, int G, float scale)
{
    const int d = get_global_id(0), t = get_global_id(1);
    if (d < D) y[t * D + d] = dequant_q8(codes, scales, KP, NG, G, ids[t], d) * scale;
}

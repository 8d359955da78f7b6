// Tiled GEMM for prefill (T > 1) and for weights the GEMV kernels cannot take.
// Variant WFMT selects the weight format: 0 dense float32 [N, WS], 1 INT4 (codes uint32
// [N, WS], see dequant_q4), 2 INT8 (codes char [N, WS], see dequant_q8). WS is the row
// stride of W in its own element type.

#if WFMT == 0
#define WCODE_T float
#define LOAD_W(n, k) W[(size_t)(n) * WS + (k)]
#elif WFMT == 1
#define WCODE_T uint
#define LOAD_W(n, k) dequant_q4(W, scales, zeros, WS, NG, G, has_zeros, (n), (k))
#else
#define WCODE_T char
#define LOAD_W(n, k) dequant_q8(W, scales, WS, NG, G, (n), (k))
#endif

// Y[T, N] = X[T, K] @ W[N, K]^T (+ bias[N]).
// A TS x TS work-group computes a tile of TS outputs (n) x TS*RT tokens (t): each item
// holds RT accumulators, so every dequantized weight staged in local memory is reused by
// TS*RT tokens. K is walked in TS-wide slices; Ws is padded by one column against
// local-memory bank conflicts.
__kernel __attribute__((reqd_work_group_size(TS, TS, 1)))
void gemm(__global float* Y, __global const float* X, __global const WCODE_T* W,
          __global const SCALE_T* scales, __global const uchar* zeros,
          __global const float* bias, int T, int N, int K, int WS, int NG, int G,
          int has_zeros, int has_bias)
{
    __local float Xs[TS * RT][TS + 1];
    __local float Ws[TS][TS + 1];
    const int lx = get_local_id(0), ly = get_local_id(1);
    const int n0 = get_group_id(0) * TS, t0 = get_group_id(1) * TS * RT;
    float acc[RT];
    for (int i = 0; i < RT; i++) acc[i] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += TS) {
        const int k = k0 + lx;
        for (int i = 0; i < RT; i++) {
            const int t = t0 + ly + i * TS;
            Xs[ly + i * TS][lx] = (t < T && k < K) ? X[(size_t)t * K + k] : 0.0f;
        }
        Ws[ly][lx] = (n0 + ly < N && k < K) ? LOAD_W(n0 + ly, k) : 0.0f;
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int kk = 0; kk < TS; kk++) {
            const float w = Ws[lx][kk];
            for (int i = 0; i < RT; i++) acc[i] += Xs[ly + i * TS][kk] * w;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const int n = n0 + lx;
    if (n >= N) return;
    const float b = has_bias ? bias[n] : 0.0f;
    for (int i = 0; i < RT; i++) {
        const int t = t0 + ly + i * TS;
        if (t < T) Y[(size_t)t * N + n] = acc[i] + b;
    }
}

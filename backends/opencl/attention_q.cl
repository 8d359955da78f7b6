// Quantized KV cache (int8 / int4 / k8v4): write (quantize) and causal GQA attention
// reading the codes directly. Variants: KBITS = 8 or 4 (K format), VBITS = 8 or 4 (V
// format); int8 = (8, 8), int4 = (4, 4), k8v4 = (8, 4). Formats: edgeinfer.backends.kvformat
// (the one source of truth; its module docstring has the formulas), per layer / position
// p / KV head h, "row" = (layer_rows + p % S)*Hkv + h, G = kv group size (power of two
// <= 32); layer_rows = the layer's first slot, S its ring length (attention.cl's layout):
//   K, 8 bits: kq char [row, hd] = symmetric codes of K rotated per group by the
//         Hadamard matrix H_G, ks half [row, hd/G] (km unused).
//   K, 4 bits: kq uchar [row, hd/2] (low nibble = even channel), ks/km half [row, hd/G],
//         asymmetric y' = q*s + m of K rotated as above, after a per-channel shift and
//         scale x = (k - koff) / kcs, koff/kcs float [Hkv, hd] of this layer (host-
//         computed k_channel_stats, fixed by the write at position 0); dequant
//         k' = (y' H_G) * kcs + koff. Only 4-bit K has koff/kcs (NULL otherwise).
//   V, 8 bits: vq char [row, hd], vs half [row] (one symmetric scale per head; vm unused).
//   V, 4 bits: vq uchar [row, hd/2], vs/vm half [row, hd/G], asymmetric, not rotated.
// f16() = round to nearest even after clipping to +-FP16_MAX (vstore_half_rte).
// The program is built with -cl-fp32-correctly-rounded-divide-sqrt so y/s rounds like numpy.

#define NG(hd) ((hd) / G)

#if KBITS == 8
#define KQ_T char
#else
#define KQ_T uchar
#endif
#if VBITS == 8
#define VQ_T char
#else
#define VQ_T uchar
#endif

// y[i] = sum_j x[j] * H_G[j][i], H_G[j][i] = (-1)^popcount(i & j) / sqrt(G) (Sylvester).
inline float hadamard_at(const float* x, int i, int G_, float hs)
{
    float acc = 0.0f;
    for (int j = 0; j < G_; j++) acc += (popcount(i & j) & 1) ? -x[j] * hs : x[j] * hs;
    return acc;
}

// Symmetric 8-bit quantization of y[n] with one f16 scale s[si] (codes at q[0..n-1]).
inline void quant_sym8(const float* y, int n, __global char* q, __global half* s, size_t si)
{
    float amax = 0.0f;
    for (int i = 0; i < n; i++) amax = fmax(amax, fabs(y[i]));
    vstore_half_rte(fmin(amax / 127.0f, FP16_MAX), si, s);
    const float d = vload_half(si, s);
    for (int i = 0; i < n; i++)
        q[i] = d == 0.0f ? 0 : (char)clamp(rint(y[i] / d), -127.0f, 127.0f);
}

// Asymmetric 4-bit quantization of one group y[G] into codes (packed) + f16 s, m.
inline void quant_group4(const float* y, int G_, __global uchar* q, __global half* s,
                         __global half* m, size_t si)
{
    float lo = y[0], hi = y[0];
    for (int i = 1; i < G_; i++) { lo = fmin(lo, y[i]); hi = fmax(hi, y[i]); }
    vstore_half_rte(clamp(lo, -FP16_MAX, FP16_MAX), si, m);
    const float m32 = vload_half(si, m);
    vstore_half_rte(clamp((hi - m32) / 15.0f, -FP16_MAX, FP16_MAX), si, s);
    const float d = vload_half(si, s);
    for (int i = 0; i < G_; i += 2) {
        const float c0 = d == 0.0f ? 0.0f : clamp(rint((y[i] - m32) / d), 0.0f, 15.0f);
        const float c1 = d == 0.0f ? 0.0f : clamp(rint((y[i + 1] - m32) / d), 0.0f, 15.0f);
        q[i / 2] = (uchar)((uint)c0 | ((uint)c1 << 4));
    }
}

inline float q4_at(__global const uchar* q, __global const half* s, __global const half* m,
                   size_t row, int dd, int hd, int G_)
{
    const uchar b = q[row * (hd / 2) + dd / 2];
    const float c = (float)((dd & 1) ? (b >> 4) : (b & 15));
    const size_t gi = row * (hd / G_) + dd / G_;
    return c * vload_half(gi, s) + vload_half(gi, m);
}

// Quantize k, v float32 [n_rows = T*Hkv, hd] (positions start_pos..) into the cache.
// One work-item per (t, h) row: the work is a few thousand flops per row.
// koff / kcs (4-bit K only, NULL otherwise): the layer's K channel statistics [Hkv, hd].
__kernel void kv_write_q(__global KQ_T* kq, __global half* ks, __global half* km,
                         __global VQ_T* vq, __global half* vs, __global half* vm,
                         __global const float* k, __global const float* v,
                         __global const float* koff, __global const float* kcs,
                         int layer_rows, int start_pos, int S, int n_rows, int hd, int G,
                         int Hkv)
{
    const int r = get_global_id(0);
    if (r >= n_rows) return;
    const size_t row = ((size_t)layer_rows + (start_pos + r / Hkv) % S) * Hkv + r % Hkv;
    __global const float* xk = k + (size_t)r * hd;
    __global const float* xv = v + (size_t)r * hd;
    const float hs = 1.0f / sqrt((float)G);
    float xg[32], y[32];
#if KBITS == 4
    __global const float* mo = koff + (r % Hkv) * hd;  // this head's channel m, c
    __global const float* co = kcs + (r % Hkv) * hd;
#endif
    for (int g = 0; g < NG(hd); g++) {
#if KBITS == 8
        for (int j = 0; j < G; j++) xg[j] = xk[g * G + j];
        for (int i = 0; i < G; i++) y[i] = hadamard_at(xg, i, G, hs);
        quant_sym8(y, G, kq + row * hd + g * G, ks, row * NG(hd) + g);
#else  // (k - m) / c: IEEE sub and (flagged) exact div
        for (int j = 0; j < G; j++) xg[j] = (xk[g * G + j] - mo[g * G + j]) / co[g * G + j];
        for (int i = 0; i < G; i++) y[i] = hadamard_at(xg, i, G, hs);
        quant_group4(y, G, kq + row * (hd / 2) + g * G / 2, ks, km, row * NG(hd) + g);
#endif
    }
#if VBITS == 8
    float amax = 0.0f;  // one scale over the whole head (hd may exceed the 32-float scratch)
    for (int i = 0; i < hd; i++) amax = fmax(amax, fabs(xv[i]));
    vstore_half_rte(fmin(amax / 127.0f, FP16_MAX), row, vs);
    const float d = vload_half(row, vs);
    for (int i = 0; i < hd; i++)
        vq[row * hd + i] = d == 0.0f ? 0 : (char)clamp(rint(xv[i] / d), -127.0f, 127.0f);
#else
    for (int g = 0; g < NG(hd); g++) {
        for (int j = 0; j < G; j++) y[j] = xv[g * G + j];
        quant_group4(y, G, vq + row * (hd / 2) + g * G / 2, vs, vm, row * NG(hd) + g);
    }
#endif
}

#if KBITS == 8
#define K_AT(row, dd) ((float)kq[(size_t)(row) * hd + (dd)] * vload_half((row) * NG(hd) + (dd) / G, ks))
#else
#define K_AT(row, dd) q4_at(kq, ks, km, (row), (dd), hd, G)
#endif
#if VBITS == 8
#define V_AT(row, dd) ((float)vq[(size_t)(row) * hd + (dd)] * vload_half((row), vs))
#else
#define V_AT(row, dd) q4_at(vq, vs, vm, (row), (dd), hd, G)
#endif

#define DPT ((MAX_HD + LWS - 1) / LWS)

#define SLOT(s0, jj, S) ((s0) + (jj) < (S) ? (s0) + (jj) : (s0) + (jj) - (S))  // attention.cl

// out[T, Hq, hd] = causal GQA attention over the quantized cache (same contract and
// online softmax as attention.cl). The query is rotated once per group (q . k' =
// (q H_G) . y' since H_G is orthonormal and symmetric), then dotted with the
// dequantized rotated keys y' directly.
__kernel __attribute__((reqd_work_group_size(LWS, 1, 1)))
void attention_q(__global float* out, __global const float* q,
                 __global const KQ_T* kq, __global const half* ks, __global const half* km,
                 __global const VQ_T* vq, __global const half* vs, __global const half* vm,
                 __global const float* koff, __global const float* kcs,
                 int layer_rows, int S, int Hq, int Hkv, int hd, int G, int start_pos,
                 int window, float scale, float softcap)
{
    __local float qraw[MAX_HD];
    __local float qs[MAX_HD];
    __local float ps[LWS];
    __local float red[LWS];
    const int h = get_group_id(0), t = get_group_id(1), lid = get_local_id(0);
    const int kvh = h / (Hq / Hkv);
    const int p = start_pos + t;
    const int lo = window > 0 ? max(0, p - window + 1) : 0;
    const int qoff = (t * Hq + h) * hd;
    const float hs = 1.0f / sqrt((float)G);
    float qm = 0.0f;  // 4-bit K: q . m, added to every score (k' = (y' H) * c + m)
#if KBITS == 4
    float qm_part = 0.0f;
    for (int d = lid; d < hd; d += LWS) {
        const float qv = q[qoff + d];
        qm_part += qv * koff[kvh * hd + d];
        qraw[d] = qv * kcs[kvh * hd + d];
    }
    qm = wg_sum(qm_part, red);
#else
    for (int d = lid; d < hd; d += LWS) qraw[d] = q[qoff + d];
#endif
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int d = lid; d < hd; d += LWS) {       // qs = q rotated per group
        const int i = d % G, base = d - i;
        float acc = 0.0f;
        for (int j = 0; j < G; j++) acc += (popcount(i & j) & 1) ? -qraw[base + j] * hs : qraw[base + j] * hs;
        qs[d] = acc;
    }
    barrier(CLK_LOCAL_MEM_FENCE);

    float m = -INFINITY, l = 0.0f;
    float acc[DPT];
    for (int i = 0; i < DPT; i++) acc[i] = 0.0f;
    for (int j0 = lo; j0 <= p; j0 += LWS) {
        const int j = j0 + lid, s0 = j0 % S;
        float s = -INFINITY;
        if (j <= p) {
            const size_t row = ((size_t)layer_rows + SLOT(s0, lid, S)) * Hkv + kvh;
            float dotv = 0.0f;
            for (int d = 0; d < hd; d++) dotv += qs[d] * K_AT(row, d);
            s = (dotv + qm) * scale;
            if (softcap > 0.0f) s = tanh(s / softcap) * softcap;
        }
        const float m_new = fmax(m, wg_max(s, red));
        const float alpha = exp(m - m_new);
        const float pj = (j <= p) ? exp(s - m_new) : 0.0f;
        ps[lid] = pj;
        l = l * alpha + wg_sum(pj, red);
        const int nb = min(LWS, p - j0 + 1);
        for (int i = 0; i < DPT; i++) {
            const int d = lid + i * LWS;
            if (d < hd) {
                float a = acc[i] * alpha;
                for (int jj = 0; jj < nb; jj++)
                    a += ps[jj] * V_AT(((size_t)layer_rows + SLOT(s0, jj, S)) * Hkv + kvh, d);
                acc[i] = a;
            }
        }
        m = m_new;
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int i = 0; i < DPT; i++) {
        const int d = lid + i * LWS;
        if (d < hd) out[qoff + d] = acc[i] * inv;
    }
}

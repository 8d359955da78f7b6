// KV-cache write and causal GQA attention over the on-device cache.
// Cache layout: per layer a ring of S slots [S, Hkv, hd], layers stacked (layer_off = the
// layer's first element); position p lives in slot p % S (S = max_tokens for a global
// layer, W - 1 + max_chunk for a sliding-window one: edgeinfer.backends.kvcache's rule,
// so every key a query can see is still held). Element type per variant KV_HALF:
// fp16 storage via vstore_half / vload_half (core OpenCL, no cl_khr_fp16 needed), values
// saturated to +-FP16_MAX on store so an outlier never becomes inf.
// All score and softmax arithmetic is float32.

#if KV_HALF
#define KV_T half
#define KV_LOAD(p, i) vload_half((i), (p))
#define KV_STORE(v, p, i) vstore_half(clamp((v), -FP16_MAX, FP16_MAX), (i), (p))
#else
#define KV_T float
#define KV_LOAD(p, i) ((p)[(i)])
#define KV_STORE(v, p, i) ((p)[(i)] = (v))
#endif

#define DPT ((MAX_HD + LWS - 1) / LWS)     // output dims per work-item

// Slot of key position j when slot s0 holds position j0 <= j and j - j0 < S (a query's
// keys always span <= S positions): no integer division in the inner loops.
#define SLOT(s0, jj, S) ((s0) + (jj) < (S) ? (s0) + (jj) : (s0) + (jj) - (S))

// k, v [T, Hkv, hd] float32 (row = Hkv*hd elements per position, n = T*row) into the
// slots of positions start_pos .. start_pos+T-1 of the layer at element layer_off.
__kernel void kv_write(__global KV_T* kc, __global KV_T* vc, __global const float* k,
                       __global const float* v, int layer_off, int start_pos, int S, int row,
                       int n)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    const int dst = layer_off + ((start_pos + i / row) % S) * row + i % row;
    KV_STORE(k[i], kc, dst);
    KV_STORE(v[i], vc, dst);
}

// Decode fusion (T = 1) of rope(q), rope(k) and kv_write: qo[Hq, hd] = rope(q),
// kc[off + i] = rope(k)[i], vc[off + i] = v[i] (i < Hkv*hd), all at position pos
// (off = the element offset of pos's slot, computed by the host). Same
// rotation as dense.cl's rope (NeoX pairs (d, d + r2), dims >= 2*r2 copied).
// One item per element of q, then k, then v: global >= (Hq + 2*Hkv) * hd.
inline float rope_at(__global const float* x, __global const float* cosv,
                     __global const float* sinv, int idx, int p, int hd, int r2)
{
    const int d = idx % hd, base = idx - d;
    if (d < r2) {
        const float c = cosv[p * r2 + d], s = sinv[p * r2 + d];
        return x[base + d] * c - x[base + d + r2] * s;
    }
    if (d < 2 * r2) {
        const int i = d - r2;
        const float c = cosv[p * r2 + i], s = sinv[p * r2 + i];
        return x[base + d] * c + x[base + i] * s;
    }
    return x[idx];
}

__kernel void rope_kv_write(__global float* qo, __global KV_T* kc, __global KV_T* vc,
                            __global const float* q, __global const float* k,
                            __global const float* v, __global const float* cosv,
                            __global const float* sinv, int pos, int Hq, int Hkv, int hd,
                            int r2, int off)
{
    int i = get_global_id(0);
    const int nq = Hq * hd, nk = Hkv * hd;
    if (i < nq) { qo[i] = rope_at(q, cosv, sinv, i, pos, hd, r2); return; }
    i -= nq;
    if (i < nk) { KV_STORE(rope_at(k, cosv, sinv, i, pos, hd, r2), kc, off + i); return; }
    i -= nk;
    if (i < nk) KV_STORE(v[i], vc, off + i);
}

// out[T, Hq, hd] = softmax_j(q[t,h] . K[j, h/(Hq/Hkv)] * scale) @ V over keys
// lo <= j <= p, p = start_pos + t, lo = max(0, p - window + 1) (window 0 = global); key
// j read from slot j % S of the layer at element layer_off.
// One work-group per (h, t). Keys are visited in blocks of LWS (one key per item) with
// an online softmax (Milakov & Gimelshein 2018; FlashAttention): running max m and
// denominator l in float32, scores max-subtracted before exp, so large |q.k|
// cannot overflow; masked keys get weight exactly 0. Every row sees at least its own key,
// so l >= 1; the l > 0 guard documents the (unreachable) empty row as output 0, not NaN.
// Optional logit soft-capping: s = tanh(s / softcap) * softcap (gemma2-style).
__kernel __attribute__((reqd_work_group_size(LWS, 1, 1)))
void attention(__global float* out, __global const float* q, __global const KV_T* kc,
               __global const KV_T* vc, int layer_off, int S, int Hq, int Hkv, int hd,
               int start_pos, int window, float scale, float softcap)
{
    __local float qs[MAX_HD];
    __local float ps[LWS];
    __local float red[LWS];
    const int h = get_group_id(0), t = get_group_id(1), lid = get_local_id(0);
    const int kvh = h / (Hq / Hkv);
    const int p = start_pos + t;
    const int lo = window > 0 ? max(0, p - window + 1) : 0;
    const int row = Hkv * hd;                      // elements per cache position
    const int kbase = layer_off + kvh * hd;
    const int qoff = (t * Hq + h) * hd;
    for (int d = lid; d < hd; d += LWS) qs[d] = q[qoff + d];
    barrier(CLK_LOCAL_MEM_FENCE);

    float m = -INFINITY, l = 0.0f;
    float acc[DPT];
    for (int i = 0; i < DPT; i++) acc[i] = 0.0f;
    for (int j0 = lo; j0 <= p; j0 += LWS) {
        const int j = j0 + lid, s0 = j0 % S;
        float s = -INFINITY;
        if (j <= p) {
            const int kj = kbase + SLOT(s0, lid, S) * row;
            float dotv = 0.0f;
            for (int d = 0; d < hd; d++) dotv += qs[d] * KV_LOAD(kc, kj + d);
            s = dotv * scale;
            if (softcap > 0.0f) s = tanh(s / softcap) * softcap;
        }
        const float m_new = fmax(m, wg_max(s, red));  // finite: key j0 <= p is visible
        const float alpha = exp(m - m_new);            // exp(-inf) = 0 on the first block
        const float pj = (j <= p) ? exp(s - m_new) : 0.0f;
        ps[lid] = pj;
        l = l * alpha + wg_sum(pj, red);               // its barriers also publish ps[]
        const int nb = min(LWS, p - j0 + 1);
        for (int i = 0; i < DPT; i++) {
            const int d = lid + i * LWS;
            if (d < hd) {
                float a = acc[i] * alpha;
                for (int jj = 0; jj < nb; jj++)
                    a += ps[jj] * KV_LOAD(vc, kbase + SLOT(s0, jj, S) * row + d);
                acc[i] = a;
            }
        }
        m = m_new;
        barrier(CLK_LOCAL_MEM_FENCE);                  // ps[] is rewritten next block
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int i = 0; i < DPT; i++) {
        const int d = lid + i * LWS;
        if (d < hd) out[qoff + d] = acc[i] * inv;
    }
}

// Split-KV ("flash-decoding", Dao et al. 2023) for long contexts: the keys are cut into
// chunks of C positions; work-group (h, t, s) runs the online softmax of attention() over
// chunk s only and writes its partial state part[t, h, s, :] = (acc[hd], m, l) unnormalized.
// attention_combine() merges the chunks: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s,
// M = max_s m_s. A chunk with no visible key writes m = -inf, l = 0 (weight e^-inf = 0).
// More work-groups in flight than heads alone give when T is 1 (decode).
__kernel __attribute__((reqd_work_group_size(LWS, 1, 1)))
void attention_split(__global float* part, __global const float* q, __global const KV_T* kc,
                     __global const KV_T* vc, int layer_off, int S, int Hq, int Hkv, int hd,
                     int start_pos, int window, float scale, float softcap, int C, int nsplit)
{
    __local float qs[MAX_HD];
    __local float ps[LWS];
    __local float red[LWS];
    const int h = get_group_id(0), t = get_group_id(1), sp = get_group_id(2);
    const int lid = get_local_id(0);
    const int kvh = h / (Hq / Hkv);
    const int p = start_pos + t;
    const int lo = max(window > 0 ? max(0, p - window + 1) : 0, sp * C);
    const int hi = min(p, sp * C + C - 1);
    const int row = Hkv * hd;
    const int kbase = layer_off + kvh * hd;
    const int qoff = (t * Hq + h) * hd;
    for (int d = lid; d < hd; d += LWS) qs[d] = q[qoff + d];
    barrier(CLK_LOCAL_MEM_FENCE);

    float m = -INFINITY, l = 0.0f;
    float acc[DPT];
    for (int i = 0; i < DPT; i++) acc[i] = 0.0f;
    for (int j0 = lo; j0 <= hi; j0 += LWS) {      // uniform: lo, hi are per work-group
        const int j = j0 + lid, s0 = j0 % S;
        float s = -INFINITY;
        if (j <= hi) {
            const int kj = kbase + SLOT(s0, lid, S) * row;
            float dotv = 0.0f;
            for (int d = 0; d < hd; d++) dotv += qs[d] * KV_LOAD(kc, kj + d);
            s = dotv * scale;
            if (softcap > 0.0f) s = tanh(s / softcap) * softcap;
        }
        const float m_new = fmax(m, wg_max(s, red));
        const float alpha = exp(m - m_new);
        const float pj = (j <= hi) ? exp(s - m_new) : 0.0f;
        ps[lid] = pj;
        l = l * alpha + wg_sum(pj, red);
        const int nb = min(LWS, hi - j0 + 1);
        for (int i = 0; i < DPT; i++) {
            const int d = lid + i * LWS;
            if (d < hd) {
                float a = acc[i] * alpha;
                for (int jj = 0; jj < nb; jj++)
                    a += ps[jj] * KV_LOAD(vc, kbase + SLOT(s0, jj, S) * row + d);
                acc[i] = a;
            }
        }
        m = m_new;
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    __global float* dst = part + ((size_t)(t * Hq + h) * nsplit + sp) * (hd + 2);
    for (int i = 0; i < DPT; i++) {
        const int d = lid + i * LWS;
        if (d < hd) dst[d] = acc[i];
    }
    if (lid == 0) { dst[hd] = m; dst[hd + 1] = l; }
}

// out[T, Hq, hd] from part[T, Hq, nsplit, hd + 2] (see attention_split). Global (Hq*LWS, T).
__kernel __attribute__((reqd_work_group_size(LWS, 1, 1)))
void attention_combine(__global float* out, __global const float* part, int Hq, int hd, int nsplit)
{
    const int h = get_group_id(0), t = get_group_id(1), lid = get_local_id(0);
    __global const float* src = part + (size_t)(t * Hq + h) * nsplit * (hd + 2);
    float mx = -INFINITY;
    for (int s = 0; s < nsplit; s++) mx = fmax(mx, src[s * (hd + 2) + hd]);
    float den = 0.0f;
    for (int s = 0; s < nsplit; s++) {
        const float ms = src[s * (hd + 2) + hd];
        den += ms == -INFINITY ? 0.0f : exp(ms - mx) * src[s * (hd + 2) + hd + 1];
    }
    const float inv = den > 0.0f ? 1.0f / den : 0.0f;
    for (int d = lid; d < hd; d += LWS) {
        float a = 0.0f;
        for (int s = 0; s < nsplit; s++) {
            const float ms = src[s * (hd + 2) + hd];
            if (ms != -INFINITY) a += exp(ms - mx) * src[s * (hd + 2) + d];
        }
        out[(t * Hq + h) * hd + d] = a * inv;
    }
}

// Shared helpers, prepended to every edgeinfer .cl program by device.py.
//
// Layout constants are NOT declared here: they arrive as -D build options generated from
// edgeinfer.backends.quantized (the one source of truth), together with the work-group
// size chosen by capability probing:
//   NIBBLES_PER_BYTE, SYMMETRIC_ZERO_4BIT, FP16_MAX   (quantized.py)
//   LWS   work-group size of 1-D reduction kernels (power of two)
//   ROWS  output rows per work-group in the GEMV kernels
//   TS    tile edge of the GEMM kernel (work-group TS x TS)
//   MAX_HD largest head dim the attention kernel holds in local memory
// Per-program variants: SCALE_HALF (scales stored as fp16, read with vload_half, which is
// core OpenCL and needs no cl_khr_fp16), KV_HALF (fp16 KV cache storage), WFMT (GEMM
// weight format 0 dense f32, 1 INT4, 2 INT8). All arithmetic is float32.

#define NIBBLES_PER_WORD (4 * NIBBLES_PER_BYTE)   // 4-bit codes per uint32 word (8)

#ifndef SCALE_HALF
#define SCALE_HALF 0
#endif
#if SCALE_HALF
#define SCALE_T half
#define LOAD_SCALE(p, i) vload_half((i), (p))
#else
#define SCALE_T float
#define LOAD_SCALE(p, i) ((p)[(i)])
#endif

// Sum of v over the work-group (size LWS, a power of two); every work-item gets the result.
// Must be reached by all work-items of the group (it contains barriers).
inline float wg_sum(float v, __local float* red)
{
    const int lid = get_local_id(0);
    red[lid] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s = LWS / 2; s > 0; s >>= 1) {
        if (lid < s) red[lid] += red[lid + s];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float r = red[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    return r;
}

// Max of v over the work-group (see wg_sum).
inline float wg_max(float v, __local float* red)
{
    const int lid = get_local_id(0);
    red[lid] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s = LWS / 2; s > 0; s >>= 1) {
        if (lid < s) red[lid] = fmax(red[lid], red[lid + s]);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float r = red[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    return r;
}

// Dequantize one INT4 weight W[n, k]: w = (q - z) * s.
// codes uint32 [N, WPR] (8 nibbles per word, low nibble first = the on-disk byte order
// read little-endian), scales [N, NG], zeros uchar [N, NG] (unpacked) or symmetric (z = 8).
inline float dequant_q4(__global const uint* codes, __global const SCALE_T* scales,
                        __global const uchar* zeros, int WPR, int NG, int G, int has_zeros,
                        int n, int k)
{
    const uint word = codes[n * WPR + k / NIBBLES_PER_WORD];
    const float q = (float)((word >> (4 * (k % NIBBLES_PER_WORD))) & 15u);
    const int g = n * NG + k / G;
    const float z = has_zeros ? (float)zeros[g] : (float)SYMMETRIC_ZERO_4BIT;
    return (q - z) * LOAD_SCALE(scales, g);
}

// Dequantize one INT8 weight W[n, k] = q * s; codes char [N, KP] (KP = in_padded rounded to 4).
inline float dequant_q8(__global const char* codes, __global const SCALE_T* scales,
                        int KP, int NG, int G, int n, int k)
{
    return (float)codes[n * KP + k] * LOAD_SCALE(scales, n * NG + k / G);
}

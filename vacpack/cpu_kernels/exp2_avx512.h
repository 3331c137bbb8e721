// 2^x on sixteen float32 lanes of an AVX-512 register, for the kernels written in its
// intrinsics (varlen_attention.c's softmax, gemm_bf16.c's SiLU).

#ifndef VACPACK_EXP2_AVX512_H
#define VACPACK_EXP2_AVX512_H

#include <immintrin.h>

// 2^x for x <= 0, float32 accuracy (relative error below 2e-7); clamped at x = -126, where
// 2^x is still a normal float, so that no caller meets a denormal.
static inline __m512 exp2_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);  // in [-0.5, 0.5]
    // 2^f = e^(f ln 2): Taylor terms (ln 2)^k / k! to degree 6.
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#endif

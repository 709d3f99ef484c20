// Experiment (not linked into Loom): which FP8 cuBLASLt products does this GPU + cuBLASLt take? For each
// combination of operand formats, output dtype, bias and beta that src/backend/cuda/fp8.cu may ask for, it
// prints the heuristic's answer and cublasLtMatmul's status, in the TN layout fp8_gemm uses
// (A = b-stored (N, K) row-major, op T; B = a-stored (M, K) row-major, op N; D column-major N x M).
// Build: nvcc -std=c++17 -arch=sm_90 -o fp8_lt_probe dev/fp8_lt_probe.cu -lcublasLt
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdint>
#include <string>

#define CK(x)                                                                      \
  do {                                                                             \
    cudaError_t e_ = (x);                                                          \
    if (e_ != cudaSuccess) {                                                       \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      return 1;                                                                    \
    }                                                                              \
  } while (0)

static const char* name(cudaDataType_t t) {
  switch (t) {
    case CUDA_R_8F_E4M3: return "e4m3";
    case CUDA_R_8F_E5M2: return "e5m2";
    case CUDA_R_16BF: return "bf16";
    case CUDA_R_16F: return "f16";
    case CUDA_R_32F: return "f32";
    default: return "?";
  }
}

int main(int argc, char** argv) {
  const bool all = argc > 1 && std::string(argv[1]) == "all";
  cublasLtHandle_t lt;
  if (cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS) { std::printf("cublasLtCreate failed\n"); return 1; }
  std::printf("cuBLASLt version %zu\n", cublasLtGetVersion());
  const int64_t M = 512, N = 384, K = 128;
  void *a, *b, *d, *bias, *ws;
  float* scales;
  const size_t wsb = 32u << 20;
  CK(cudaMalloc(&a, N * K));
  CK(cudaMalloc(&b, M * K));
  CK(cudaMalloc(&d, M * N * 4));
  CK(cudaMalloc(&bias, N * 4));
  CK(cudaMalloc(&ws, wsb));
  CK(cudaMalloc(&scales, 8));
  CK(cudaMemset(a, 0x38, N * K));
  CK(cudaMemset(b, 0x38, M * K));
  CK(cudaMemset(d, 0, M * N * 4));
  CK(cudaMemset(bias, 0, N * 4));
  const float ones[2] = {1.0f, 1.0f};
  CK(cudaMemcpy(scales, ones, 8, cudaMemcpyHostToDevice));
  const float* sa = scales;
  const float* sb = scales + 1;

  const cudaDataType_t ops[3][2] = {{CUDA_R_8F_E4M3, CUDA_R_8F_E4M3}, {CUDA_R_8F_E4M3, CUDA_R_8F_E5M2},
                                    {CUDA_R_8F_E5M2, CUDA_R_8F_E4M3}};
  const cudaDataType_t outs[3] = {CUDA_R_16BF, CUDA_R_32F, CUDA_R_16F};
  for (auto& ab : ops) {
    if (!all) break;
    for (cudaDataType_t dt : outs)
      for (int with_bias = 0; with_bias < 2; ++with_bias)
        for (int beta_one = 0; beta_one < 2; ++beta_one) {
          for (int c_is_d = 1; c_is_d >= 0; --c_is_d) {
            if (!c_is_d && dt != CUDA_R_32F) continue;  // C bf16 with D f32: a variant to try
            cublasLtMatmulDesc_t desc;
            cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
            const int32_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
            cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
            cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
            cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa));
            cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb));
            if (with_bias) {
              const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
              cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi));
              cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias));
              const cudaDataType_t bt = dt == CUDA_R_32F ? CUDA_R_16BF : dt;
              cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt));
            }
            cublasLtMatrixLayout_t la, lb, lc, ld;
            cublasLtMatrixLayoutCreate(&la, ab[0], K, N, K);
            cublasLtMatrixLayoutCreate(&lb, ab[1], K, M, K);
            cublasLtMatrixLayoutCreate(&ld, dt, N, M, N);
            cublasLtMatrixLayoutCreate(&lc, c_is_d ? dt : CUDA_R_16BF, N, M, N);
            cublasLtMatmulPreference_t pref;
            cublasLtMatmulPreferenceCreate(&pref);
            uint64_t w = wsb;
            cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &w, sizeof(w));
            cublasLtMatmulHeuristicResult_t res{};
            int count = 0;
            cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, ld, pref, 1, &res, &count);
            cublasStatus_t ms = CUBLAS_STATUS_NOT_SUPPORTED;
            const float alpha = 1.0f, beta = beta_one ? 1.0f : 0.0f;
            if (hs == CUBLAS_STATUS_SUCCESS && count > 0) {
              ms = cublasLtMatmul(lt, desc, &alpha, a, la, b, lb, &beta, d, lc, d, ld, &res.algo, ws, wsb, 0);
              cudaError_t e = cudaDeviceSynchronize();
              if (e != cudaSuccess) std::printf("  (sync: %s)\n", cudaGetErrorString(e));
            }
            std::printf("A %s x B %s -> D %s%s  C %s  bias %d  beta %d : heuristic %d (count %d)  matmul %d\n",
                        name(ab[0]), name(ab[1]), name(dt), "", c_is_d ? name(dt) : "bf16", with_bias, beta_one,
                        int(hs), count, int(ms));
            cublasLtMatmulPreferenceDestroy(pref);
            cublasLtMatrixLayoutDestroy(la);
            cublasLtMatrixLayoutDestroy(lb);
            cublasLtMatrixLayoutDestroy(lc);
            cublasLtMatrixLayoutDestroy(ld);
            cublasLtMatmulDescDestroy(desc);
          }
        }
  }
  // Variants of the plainest FP8 case (e4m3 x e4m3 -> bf16, no bias, beta 0), each changing one thing, and
  // a bf16 control; run with CUBLASLT_LOG_MASK=31 to read cuBLASLt's reasons.
  struct Variant {
    const char* what;
    cudaDataType_t ab;
    bool c_null, separate_d, scales, fast_accum;
  };
  const Variant vs[] = {{"fp8 baseline (C = D)", CUDA_R_8F_E4M3, false, false, true, false},
                        {"fp8 C = nullptr, D separate", CUDA_R_8F_E4M3, true, true, true, false},
                        {"fp8 C, D separate buffers", CUDA_R_8F_E4M3, false, true, true, false},
                        {"fp8 no scale pointers", CUDA_R_8F_E4M3, false, false, false, false},
                        {"fp8 fast accumulation", CUDA_R_8F_E4M3, false, false, true, true},
                        {"bf16 control", CUDA_R_16BF, false, false, false, false}};
  void* d2;
  CK(cudaMalloc(&d2, M * N * 4));
  for (const Variant& v : vs) {
    cublasLtMatmulDesc_t desc;
    cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    const int32_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
    if (v.scales) {
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa));
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb));
    }
    if (v.fast_accum) {
      const int8_t one = 1;
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &one, sizeof(one));
    }
    const int64_t es = v.ab == CUDA_R_16BF ? 2 : 1;
    void *aa = a, *bb = b;
    if (es == 2) {
      CK(cudaMalloc(&aa, N * K * 2));
      CK(cudaMalloc(&bb, M * K * 2));
      CK(cudaMemset(aa, 0, N * K * 2));
      CK(cudaMemset(bb, 0, M * K * 2));
    }
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatrixLayoutCreate(&la, v.ab, K, N, K);
    cublasLtMatrixLayoutCreate(&lb, v.ab, K, M, K);
    cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, N, M, N);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    uint64_t w = wsb;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &w, sizeof(w));
    cublasLtMatmulHeuristicResult_t res{};
    int count = 0;
    const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 1, &res, &count);
    cublasStatus_t ms = CUBLAS_STATUS_NOT_SUPPORTED;
    const float alpha = 1.0f, beta = 0.0f;
    if (hs == CUBLAS_STATUS_SUCCESS && count > 0) {
      void* cptr = v.c_null ? nullptr : d;
      void* dptr = v.separate_d ? d2 : d;
      ms = cublasLtMatmul(lt, desc, &alpha, aa, la, bb, lb, &beta, cptr, lc, dptr, lc, &res.algo, ws, wsb, 0);
      cudaError_t e = cudaDeviceSynchronize();
      if (e != cudaSuccess) std::printf("  (sync: %s)\n", cudaGetErrorString(e));
    }
    std::printf("variant %-30s: heuristic %d (count %d, workspace %zu)  matmul %d\n", v.what, int(hs), count,
                size_t(res.workspaceSize), int(ms));
    if (es == 2) {
      cudaFree(aa);
      cudaFree(bb);
    }
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(desc);
  }
  return 0;
}

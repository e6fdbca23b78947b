/*
 * checks.h: return-on-failure wrappers for CUDA, NCCL and cuBLAS calls in host code (internal).
 * Each turns a failing call into a tw_status with a message naming the function, the call and
 * the library's own error string. cuBLAS users include <cublas_v2.h> themselves.
 */
#ifndef TW_CHECKS_H
#define TW_CHECKS_H

#include <cuda_runtime.h>
#include <nccl.h>

#include "core.h"

#define TW_CUDA_TRY(expr)                                                \
  do {                                                                   \
    cudaError_t tw__e = (expr);                                          \
    if (tw__e != cudaSuccess)                                            \
      return tw__fail(TW_ERR_CUDA, "%s: %s failed: %s", __func__, #expr, \
                      cudaGetErrorString(tw__e));                        \
  } while (0)

#define TW_NCCL_TRY(expr)                                                     \
  do {                                                                        \
    ncclResult_t tw__r = (expr);                                              \
    if (tw__r != ncclSuccess)                                                 \
      return tw__fail(TW_ERR_NCCL, "%s: %s failed: %s (%s)", __func__, #expr, \
                      ncclGetErrorString(tw__r), ncclGetLastError(NULL));     \
  } while (0)

#define TW_CUBLAS_TRY(expr)                                                \
  do {                                                                     \
    cublasStatus_t tw__c = (expr);                                         \
    if (tw__c != CUBLAS_STATUS_SUCCESS)                                    \
      return tw__fail(TW_ERR_CUBLAS, "%s: %s failed: %s", __func__, #expr, \
                      cublasGetStatusString(tw__c));                       \
  } while (0)

#endif /* TW_CHECKS_H */

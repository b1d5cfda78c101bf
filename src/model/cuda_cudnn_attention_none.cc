// cuda_cudnn_attention.h in a CUDA build without the cuDNN frontend's headers
// (deploy/cudnn-frontend.sh was not run before configuring): the engine is never created, so the
// CUDA ops always run their own attention kernels, and the run says so once.
#include "common/log.h"
#include "model/cuda_cudnn_attention.h"

namespace strata::model::cuda::detail {

class CudnnSdpa {};

bool CudnnSdpaBuilt() {
  return false;
}

CudnnSdpa* CudnnSdpaCreate(void* /*stream*/, std::string* why) {
  *why =
      "this build has no cuDNN frontend: run deploy/cudnn-frontend.sh, then configure and build "
      "again";
  STRATA_LOG_ONCE(info, model,
                  "attention: cuDNN's fused attention is not available ({}); "
                  "Strata's own attention kernels run",
                  *why);
  return nullptr;
}

void CudnnSdpaDestroy(CudnnSdpa* engine) {
  delete engine;
}

void CudnnSdpaNote(const std::string& message) {
  STRATA_LOG(warn, model, "attention: {}", message);
}

std::string CudnnSdpaDescription(const CudnnSdpa* /*engine*/) {
  return {};
}

bool CudnnSdpaPrepare(CudnnSdpa* /*engine*/, const SdpaShape& /*shape*/, size_t* /*forward_bytes*/,
                      size_t* /*backward_bytes*/, std::string* why) {
  *why = "this build has no cuDNN frontend";
  return false;
}

OpError CudnnSdpaForward(CudnnSdpa* /*engine*/, const SdpaShape& /*shape*/, const void* /*q*/,
                         const void* /*k*/, const void* /*v*/, void* /*o*/, float* /*stats*/,
                         void* /*workspace*/) {
  return OpError{ErrorSource::kArgument, 0, "this build has no cuDNN frontend", "AttentionForward"};
}

OpError CudnnSdpaBackward(CudnnSdpa* /*engine*/, const SdpaShape& /*shape*/, const void* /*q*/,
                          const void* /*k*/, const void* /*v*/, const void* /*o*/,
                          const void* /*dout*/, const float* /*stats*/, void* /*dq*/, void* /*dk*/,
                          void* /*dv*/, void* /*workspace*/) {
  return OpError{ErrorSource::kArgument, 0, "this build has no cuDNN frontend",
                 "AttentionBackward"};
}

}  // namespace strata::model::cuda::detail

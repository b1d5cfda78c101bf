// cuDNN's fused attention through the cuDNN frontend (cuda_cudnn_attention.h). The only file that
// includes the frontend: its headers take about 100 s and 2 GB to compile, so nothing else should.
#define NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING 1

#include "model/cuda_cudnn_attention.h"

#include <cuda_runtime.h>
#include <cudnn_frontend.h>
#include <fmt/format.h>

#include <exception>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "common/log.h"
#include "model/cudnn_loader.h"

// The frontend's dynamic-loading mode reads cuDNN's functions from this handle (the library
// cudnn_loader.h found); it is set once, before the first frontend call.
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace strata::model::cuda::detail {

namespace fe = cudnn_frontend;

namespace {

// The graphs' tensors, by uid.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDOut, kDQ, kDK, kDV };

std::string ShapeName(const SdpaShape& s) {
  return fmt::format("batch {}, seq {}, {}/{} heads, head_dim {}, {}", s.batch, s.seq, s.heads,
                     s.kv_heads, s.head_dim, s.dtype == DType::kBF16 ? "bf16" : "fp16");
}

// [batch, heads, seq, head_dim] over rows of [batch * seq, heads * head_dim] (the ops' layout).
std::vector<int64_t> Dims(const SdpaShape& s, int64_t heads) {
  return {s.batch, heads, s.seq, s.head_dim};
}
std::vector<int64_t> Strides(const SdpaShape& s, int64_t heads) {
  return {s.seq * heads * s.head_dim, s.head_dim, heads * s.head_dim, 1};
}
std::vector<int64_t> StatsDims(const SdpaShape& s) {
  return {s.batch, s.heads, s.seq, 1};
}
std::vector<int64_t> StatsStrides(const SdpaShape& s) {
  return {s.heads * s.seq, s.seq, 1, 1};
}

std::shared_ptr<fe::graph::Tensor_attributes> Input(fe::graph::Graph& g, const char* name,
                                                    int64_t uid, std::vector<int64_t> dims,
                                                    std::vector<int64_t> strides) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim(std::move(dims))
                      .set_stride(std::move(strides)));
}

std::shared_ptr<fe::graph::Graph> NewGraph(const SdpaShape& s) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(s.dtype == DType::kBF16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

// validate .. build_plans; "" when built, else what failed.
std::string Build(fe::graph::Graph& g, cudnnHandle_t handle, int64_t* workspace) {
  auto step = [](fe::error_t e, const char* what) -> std::string {
    return e.is_good() ? std::string() : fmt::format("{}: {}", what, e.get_message());
  };
  std::string why;
  if (!(why = step(g.validate(), "validate")).empty()) return why;
  if (!(why = step(g.build_operation_graph(handle), "build_operation_graph")).empty()) return why;
  if (!(why = step(g.create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans"))
           .empty()) {
    return why;
  }
  if (!(why = step(g.check_support(handle), "check_support")).empty()) return why;
  if (!(why = step(g.build_plans(handle), "build_plans")).empty()) return why;
  return step(g.get_workspace_size(*workspace), "get_workspace_size");
}

struct Graphs {
  SdpaShape shape;
  std::shared_ptr<fe::graph::Graph> forward, backward;
  int64_t forward_bytes = 0, backward_bytes = 0;
  std::string refused;  // why cuDNN cannot run this shape ("" when it can)
};

std::string NotBuiltOrLoaded() {
  const Result<cudnn::Library>& lib = cudnn::ProcessLibrary();
  if (!lib.ok()) return std::string(lib.status().message());
  static std::once_flag once;
  std::call_once(once, [&] { fe::cudnn_dlhandle = lib->handle; });
  return "";
}

}  // namespace

class CudnnSdpa {
 public:
  cudnnHandle_t handle = nullptr;
  cudaStream_t stream = nullptr;
  std::string description;
  std::vector<Graphs> graphs;

  Graphs* Find(const SdpaShape& s) {
    for (Graphs& g : graphs) {
      if (g.shape == s) return &g;
    }
    return nullptr;
  }
};

bool CudnnSdpaBuilt() {
  return true;
}

CudnnSdpa* CudnnSdpaCreate(void* stream, std::string* why) {
  auto fail = [&](std::string reason) -> CudnnSdpa* {
    STRATA_LOG_ONCE(info, model,
                    "attention: cuDNN's fused attention is not available ({}); Strata's own "
                    "attention kernels run",
                    reason);
    *why = std::move(reason);
    return nullptr;
  };
  std::string reason = NotBuiltOrLoaded();
  if (!reason.empty()) return fail(std::move(reason));
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return fail("the current GPU's compute capability could not be read");
  }
  if (major < 8) {
    return fail(fmt::format("the GPU is sm_{}{}; cuDNN's fused attention needs sm_80 or newer",
                            major, minor));
  }
  auto engine = std::make_unique<CudnnSdpa>();
  engine->stream = static_cast<cudaStream_t>(stream);
  try {
    const cudnnStatus_t st = fe::detail::create_handle(&engine->handle);
    if (st != CUDNN_STATUS_SUCCESS) {
      return fail(fmt::format("cudnnCreate failed with status {}", static_cast<int>(st)));
    }
    const cudnnStatus_t set = fe::detail::set_stream(engine->handle, engine->stream);
    if (set != CUDNN_STATUS_SUCCESS) {
      (void)fe::detail::destroy_handle(engine->handle);
      return fail(fmt::format("cudnnSetStream failed with status {}", static_cast<int>(set)));
    }
  } catch (const std::exception& e) {
    return fail(fmt::format("the cuDNN frontend could not start: {}", e.what()));
  }
  const cudnn::Library& lib = *cudnn::ProcessLibrary();
  engine->description = fmt::format("cuDNN {} ({})", cudnn::VersionString(lib.version), lib.path);
  STRATA_LOG_ONCE(info, model, "attention: fused attention from {}, found through {}",
                  engine->description, lib.source);
  return engine.release();
}

void CudnnSdpaDestroy(CudnnSdpa* engine) {
  if (engine == nullptr) return;
  try {
    engine->graphs.clear();
    if (engine->handle != nullptr) (void)fe::detail::destroy_handle(engine->handle);
  } catch (const std::exception&) {
    // Nothing to do at tear-down: the process keeps cuDNN loaded.
  }
  delete engine;
}

void CudnnSdpaNote(const std::string& message) {
  static std::mutex mutex;
  static std::vector<std::string> said;
  std::lock_guard<std::mutex> lock(mutex);
  for (const std::string& m : said) {
    if (m == message) return;
  }
  said.push_back(message);
  STRATA_LOG(warn, model, "attention: {}", message);
}

std::string CudnnSdpaDescription(const CudnnSdpa* engine) {
  return engine != nullptr ? engine->description : std::string();
}

bool CudnnSdpaPrepare(CudnnSdpa* engine, const SdpaShape& s, size_t* forward_bytes,
                      size_t* backward_bytes, std::string* why) {
  Graphs* known = engine->Find(s);
  if (known == nullptr) {
    Graphs g;
    g.shape = s;
    try {
      // Forward: O and the row statistics (the backward's input).
      g.forward = NewGraph(s);
      auto q = Input(*g.forward, "Q", kQ, Dims(s, s.heads), Strides(s, s.heads));
      auto k = Input(*g.forward, "K", kK, Dims(s, s.kv_heads), Strides(s, s.kv_heads));
      auto v = Input(*g.forward, "V", kV, Dims(s, s.kv_heads), Strides(s, s.kv_heads));
      auto options = fe::graph::SDPA_attributes()
                         .set_name("strata_attention")
                         .set_generate_stats(true)
                         .set_causal_mask(true)
                         .set_attn_scale(s.scale);
      auto [o, stats] = g.forward->sdpa(q, k, v, options);
      o->set_output(true).set_uid(kO).set_dim(Dims(s, s.heads)).set_stride(Strides(s, s.heads));
      stats->set_output(true)
          .set_uid(kStats)
          .set_data_type(fe::DataType_t::FLOAT)
          .set_dim(StatsDims(s))
          .set_stride(StatsStrides(s));
      std::string failed = Build(*g.forward, engine->handle, &g.forward_bytes);
      if (failed.empty()) {
        // Backward, deterministic (no atomics in dQ), as every op of cuda_ops.h.
        g.backward = NewGraph(s);
        auto bq = Input(*g.backward, "Q", kQ, Dims(s, s.heads), Strides(s, s.heads));
        auto bk = Input(*g.backward, "K", kK, Dims(s, s.kv_heads), Strides(s, s.kv_heads));
        auto bv = Input(*g.backward, "V", kV, Dims(s, s.kv_heads), Strides(s, s.kv_heads));
        auto bo = Input(*g.backward, "O", kO, Dims(s, s.heads), Strides(s, s.heads));
        auto bdo = Input(*g.backward, "dO", kDOut, Dims(s, s.heads), Strides(s, s.heads));
        auto bstats = Input(*g.backward, "Stats", kStats, StatsDims(s), StatsStrides(s));
        bstats->set_data_type(fe::DataType_t::FLOAT);
        auto backward_options = fe::graph::SDPA_backward_attributes()
                                    .set_name("strata_attention_backward")
                                    .set_causal_mask(true)
                                    .set_attn_scale(s.scale)
                                    .set_deterministic_algorithm(true);
        auto [dq, dk, dv] =
            g.backward->sdpa_backward(bq, bk, bv, bo, bdo, bstats, backward_options);
        dq->set_output(true).set_uid(kDQ).set_dim(Dims(s, s.heads)).set_stride(Strides(s, s.heads));
        dk->set_output(true)
            .set_uid(kDK)
            .set_dim(Dims(s, s.kv_heads))
            .set_stride(Strides(s, s.kv_heads));
        dv->set_output(true)
            .set_uid(kDV)
            .set_dim(Dims(s, s.kv_heads))
            .set_stride(Strides(s, s.kv_heads));
        failed = Build(*g.backward, engine->handle, &g.backward_bytes);
        if (!failed.empty()) failed = "backward: " + failed;
      } else {
        failed = "forward: " + failed;
      }
      g.refused = failed;
    } catch (const std::exception& e) {
      g.refused = fmt::format("the cuDNN frontend threw: {}", e.what());
    }
    if (!g.refused.empty()) {
      g.forward.reset();
      g.backward.reset();
      STRATA_LOG(warn, model,
                 "attention: cuDNN cannot run {} ({}); Strata's own kernels run for this shape",
                 ShapeName(s), g.refused);
    } else {
      STRATA_LOG(debug, model, "attention: cuDNN graphs built for {} (workspace {} + {} bytes)",
                 ShapeName(s), g.forward_bytes, g.backward_bytes);
    }
    engine->graphs.push_back(std::move(g));
    known = &engine->graphs.back();
  }
  if (!known->refused.empty()) {
    *why = known->refused;
    return false;
  }
  *forward_bytes = static_cast<size_t>(known->forward_bytes);
  *backward_bytes = static_cast<size_t>(known->backward_bytes);
  return true;
}

namespace {

OpError Execute(CudnnSdpa* engine, const SdpaShape& s, bool forward,
                std::unordered_map<int64_t, void*>& pack, void* workspace) {
  const char* op = forward ? "AttentionForward" : "AttentionBackward";
  Graphs* g = engine->Find(s);
  if (g == nullptr || !g->refused.empty()) {
    return OpError{ErrorSource::kArgument, 0, "cuDNN attention called for a shape not prepared",
                   op};
  }
  try {
    fe::error_t e = (forward ? g->forward : g->backward)->execute(engine->handle, pack, workspace);
    if (e.is_good()) return OpError{};
    STRATA_LOG(error, model, "attention: cuDNN's {} failed for {}: {}", op, ShapeName(s),
               e.get_message());
    return OpError{ErrorSource::kCudnn, static_cast<int>(e.get_code()), "cuDNN graph execute", op};
  } catch (const std::exception& ex) {
    STRATA_LOG(error, model, "attention: cuDNN's {} threw for {}: {}", op, ShapeName(s), ex.what());
    return OpError{ErrorSource::kCudnn, -1, "cuDNN graph execute (an exception)", op};
  }
}

}  // namespace

OpError CudnnSdpaForward(CudnnSdpa* engine, const SdpaShape& s, const void* q, const void* k,
                         const void* v, void* o, float* stats, void* workspace) {
  std::unordered_map<int64_t, void*> pack = {{kQ, const_cast<void*>(q)},
                                             {kK, const_cast<void*>(k)},
                                             {kV, const_cast<void*>(v)},
                                             {kO, o},
                                             {kStats, stats}};
  return Execute(engine, s, true, pack, workspace);
}

OpError CudnnSdpaBackward(CudnnSdpa* engine, const SdpaShape& s, const void* q, const void* k,
                          const void* v, const void* o, const void* dout, const float* stats,
                          void* dq, void* dk, void* dv, void* workspace) {
  std::unordered_map<int64_t, void*> pack = {{kQ, const_cast<void*>(q)},
                                             {kK, const_cast<void*>(k)},
                                             {kV, const_cast<void*>(v)},
                                             {kO, const_cast<void*>(o)},
                                             {kDOut, const_cast<void*>(dout)},
                                             {kStats, const_cast<float*>(stats)},
                                             {kDQ, dq},
                                             {kDK, dk},
                                             {kDV, dv}};
  return Execute(engine, s, false, pack, workspace);
}

}  // namespace strata::model::cuda::detail

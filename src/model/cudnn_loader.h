// cuDNN, found and loaded at run time (never linked): the CUDA ops' fused attention
// (cuda_cudnn_attention.cc) runs on whatever libcudnn.so.9 this finds, and a machine without one
// runs the hand-written kernels instead. Host code only (dlopen), built with or without CUDA, so
// that the search itself is tested everywhere (tests/model/cudnn_loader_test.cc).
//
// Where it looks, in order (docs/gpu.md, "cuDNN"):
//   1. STRATA_CUDNN_PATH, when set: a libcudnn.so.9 file, or a directory holding one. The only
//      place looked at then, so that a wrong setting fails instead of finding another cuDNN.
//   2. The dynamic loader's own search for "libcudnn.so.9" (LD_LIBRARY_PATH, the ld.so cache: a
//      system package or a CUDA install registered with ldconfig).
//   3. The CUDA toolkit: $CUDA_HOME/lib64, $CUDA_PATH/lib64, /usr/local/cuda/lib64.
//   4. An installed PyTorch's cuDNN: nvidia/cudnn/lib under each Python site-packages or
//      dist-packages directory of a virtual environment ($VIRTUAL_ENV), conda ($CONDA_PREFIX,
//      /opt/conda), each python3 on $PATH (its bin/'s parent), the user (~/.local), /usr/local,
//      /usr, and $PYTHONPATH.
// The first that loads and reports cuDNN 9.0 or newer wins. A library loaded from a directory has
// its sibling sub-libraries (libcudnn_graph.so.9 and the others) loaded from the same directory,
// so that cuDNN's own lazy loading finds them when that directory is not on the search path.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "strata/status.h"

namespace strata::model::cudnn {

inline constexpr const char* kLibraryName = "libcudnn.so.9";
inline constexpr size_t kMinimumVersion = 90000;  // cudnnGetVersion()'s number for 9.0.0

// One place to try: a file path, or the bare library name (the dynamic loader's own search).
struct Candidate {
  std::string path;
  std::string source;  // what it is, for messages ("STRATA_CUDNN_PATH", "the CUDA toolkit", ...)
};

// The inputs of the search, taken from the environment by SettingsFromEnvironment.
struct SearchSettings {
  std::string explicit_path;              // STRATA_CUDNN_PATH ("" when unset)
  std::vector<std::string> cuda_homes;    // directories with lib64/ below them
  std::vector<std::string> python_roots;  // site-packages / dist-packages directories
};
SearchSettings SettingsFromEnvironment();

// The places to try, in order: only existing files (and the bare name), each once.
std::vector<Candidate> Candidates(const SearchSettings& settings);

struct Library {
  void* handle = nullptr;  // dlopen's; never closed (cuDNN stays loaded for the process)
  std::string path;        // the file loaded
  std::string source;
  size_t version = 0;  // cudnnGetVersion(): 91900 is 9.19.0
};
// "9.19.0" for 91900 (cuDNN 9's numbering: major * 10000 + minor * 100 + patch); "8.9.6" for 8906
// (cuDNN 8's: major * 1000 + minor * 100 + patch).
std::string VersionString(size_t version);

// Tries `candidates` in order and returns the first that loads and reports at least
// kMinimumVersion. The error (NotFound) names every candidate tried and why each failed.
Result<Library> LoadFirst(const std::vector<Candidate>& candidates);

// The process's cuDNN: LoadFirst(Candidates(SettingsFromEnvironment())) on the first call (thread
// safe), the same answer after that.
const Result<Library>& ProcessLibrary();

}  // namespace strata::model::cudnn

#include "model/cudnn_loader.h"

#include <dlfcn.h>
#include <fmt/format.h>
#include <glob.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <cstdlib>
#include <set>
#include <string_view>

namespace strata::model::cudnn {
namespace {

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string() : std::string(v);
}

bool IsFile(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool IsDirectory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string RealPath(const std::string& path) {
  char buf[PATH_MAX];
  return ::realpath(path.c_str(), buf) != nullptr ? std::string(buf) : path;
}

// Every existing path matching `pattern`, sorted (glob's order).
std::vector<std::string> Glob(const std::string& pattern) {
  std::vector<std::string> out;
  glob_t g{};
  if (::glob(pattern.c_str(), 0, nullptr, &g) == 0) {
    for (size_t i = 0; i < g.gl_pathc; ++i)
      out.emplace_back(g.gl_pathv[i]);
  }
  ::globfree(&g);
  return out;
}

std::vector<std::string> SplitPath(const std::string& list) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t end = std::min(list.find(':', start), list.size());
    if (end > start) out.push_back(list.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

// The sub-libraries cuDNN 9 loads lazily by name, in dependency order.
constexpr const char* kSubLibraries[] = {"libcudnn_graph.so.9",
                                         "libcudnn_engines_precompiled.so.9",
                                         "libcudnn_engines_runtime_compiled.so.9",
                                         "libcudnn_heuristic.so.9",
                                         "libcudnn_ops.so.9",
                                         "libcudnn_cnn.so.9",
                                         "libcudnn_adv.so.9"};

std::string DlError() {
  const char* e = ::dlerror();
  return e != nullptr ? std::string(e) : std::string("unknown dlopen error");
}

// The file `symbol` was loaded from (a bare name resolves to the loader's choice).
std::string LoadedPath(void* symbol, const std::string& fallback) {
  Dl_info info{};
  if (::dladdr(symbol, &info) != 0 && info.dli_fname != nullptr) return RealPath(info.dli_fname);
  return fallback;
}

}  // namespace

SearchSettings SettingsFromEnvironment() {
  SearchSettings s;
  s.explicit_path = Env("STRATA_CUDNN_PATH");
  for (const char* var : {"CUDA_HOME", "CUDA_PATH"}) {
    const std::string v = Env(var);
    if (!v.empty()) s.cuda_homes.push_back(v);
  }
  s.cuda_homes.emplace_back("/usr/local/cuda");
  std::vector<std::string> prefixes;
  for (const char* var : {"VIRTUAL_ENV", "CONDA_PREFIX"}) {
    const std::string v = Env(var);
    if (!v.empty()) prefixes.push_back(v);
  }
  // The environment of each python3 on PATH (a virtual environment need not be activated to be
  // the python3 that runs: /opt/torch/.venv/bin first on PATH, say).
  for (const std::string& dir : SplitPath(Env("PATH"))) {
    const size_t slash = dir.find_last_of('/');
    if (slash == std::string::npos || dir.substr(slash + 1) != "bin" || slash == 0) continue;
    if (IsFile(dir + "/python3")) prefixes.push_back(dir.substr(0, slash));
  }
  const std::string home = Env("HOME");
  if (!home.empty()) prefixes.push_back(home + "/.local");
  for (const char* p : {"/opt/conda", "/usr/local", "/usr"})
    prefixes.emplace_back(p);
  for (const std::string& prefix : prefixes) {
    for (const char* kind : {"site-packages", "dist-packages"}) {
      for (std::string& dir : Glob(fmt::format("{}/lib/python3*/{}", prefix, kind))) {
        s.python_roots.push_back(std::move(dir));
      }
    }
  }
  s.python_roots.emplace_back("/usr/lib/python3/dist-packages");  // Debian's own
  for (std::string& dir : SplitPath(Env("PYTHONPATH")))
    s.python_roots.push_back(std::move(dir));
  return s;
}

std::vector<Candidate> Candidates(const SearchSettings& settings) {
  if (!settings.explicit_path.empty()) {
    const std::string& p = settings.explicit_path;
    return {{IsDirectory(p) ? p + "/" + kLibraryName : p, "STRATA_CUDNN_PATH"}};
  }
  std::vector<Candidate> out;
  out.push_back({kLibraryName, "the dynamic loader's search (LD_LIBRARY_PATH, ld.so cache)"});
  std::set<std::string> seen;
  auto add = [&](const std::string& path, const std::string& source) {
    if (!IsFile(path) || !seen.insert(RealPath(path)).second) return;
    out.push_back({path, source});
  };
  for (const std::string& home : settings.cuda_homes) {
    add(home + "/lib64/" + kLibraryName, "the CUDA toolkit (" + home + ")");
  }
  for (const std::string& root : settings.python_roots) {
    add(root + "/nvidia/cudnn/lib/" + kLibraryName, "a Python package (nvidia-cudnn, PyTorch's)");
  }
  return out;
}

std::string VersionString(size_t version) {
  if (version < 10000) {  // cuDNN 8 and older: major * 1000 + minor * 100 + patch
    return fmt::format("{}.{}.{}", version / 1000, version / 100 % 10, version % 100);
  }
  return fmt::format("{}.{}.{}", version / 10000, version / 100 % 100, version % 100);
}

Result<Library> LoadFirst(const std::vector<Candidate>& candidates) {
  std::vector<std::string> failures;
  for (const Candidate& c : candidates) {
    const bool is_path = c.path.find('/') != std::string::npos;
    if (is_path && !IsFile(c.path)) {
      failures.push_back(fmt::format("{} ({}): no such file", c.path, c.source));
      continue;
    }
    ::dlerror();
    void* handle = ::dlopen(c.path.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (handle == nullptr) {
      failures.push_back(fmt::format("{} ({}): {}", c.path, c.source, DlError()));
      continue;
    }
    using GetVersion = size_t (*)();
    void* symbol = ::dlsym(handle, "cudnnGetVersion");
    if (symbol == nullptr) {
      failures.push_back(fmt::format("{} ({}): no cudnnGetVersion: not cuDNN", c.path, c.source));
      ::dlclose(handle);
      continue;
    }
    const size_t version = reinterpret_cast<GetVersion>(symbol)();
    const std::string path = LoadedPath(symbol, c.path);
    if (version < kMinimumVersion) {
      failures.push_back(fmt::format("{} ({}): cuDNN {}, older than the 9.0 Strata needs", path,
                                     c.source, VersionString(version)));
      ::dlclose(handle);
      continue;
    }
    // The sub-libraries beside it, so that cuDNN's loading by name finds these (a missing or
    // unloadable one is cuDNN's to report when an engine needs it).
    const size_t slash = path.rfind('/');
    if (slash != std::string::npos) {
      const std::string dir = path.substr(0, slash + 1);
      for (const char* sub : kSubLibraries) {
        const std::string sub_path = dir + sub;
        if (IsFile(sub_path)) (void)::dlopen(sub_path.c_str(), RTLD_LAZY | RTLD_GLOBAL);
      }
    }
    return Library{handle, path, c.source, version};
  }
  std::string message = fmt::format("no usable cuDNN 9 ({}) found; tried:", kLibraryName);
  for (const std::string& f : failures)
    message += "\n  " + f;
  message +=
      "\nSet STRATA_CUDNN_PATH to a libcudnn.so.9 or its directory (for example a PyTorch "
      "install's site-packages/nvidia/cudnn/lib).";
  return NotFoundError(message);
}

const Result<Library>& ProcessLibrary() {
  static const Result<Library> library = LoadFirst(Candidates(SettingsFromEnvironment()));
  return library;
}

}  // namespace strata::model::cudnn

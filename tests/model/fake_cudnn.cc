// A stand-in for libcudnn.so.9 in cudnn_loader_test.cc: only cudnnGetVersion, answering the
// version it was built with (FAKE_CUDNN_VERSION).
#include <cstddef>

extern "C" __attribute__((visibility("default"))) size_t cudnnGetVersion() {
  return FAKE_CUDNN_VERSION;
}

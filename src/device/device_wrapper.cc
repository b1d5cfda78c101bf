#include "device/device_wrapper.h"

#include <utility>

namespace strata::device {

DeviceWrapper::DeviceWrapper(std::unique_ptr<Device> inner, std::string name)
    : inner_(std::move(inner)), name_(std::move(name)) {}

std::string_view DeviceWrapper::name() const {
  return name_.empty() ? inner_->name() : std::string_view(name_);
}

}  // namespace strata::device

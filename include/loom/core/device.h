// Where a tensor lives.
#pragma once
#include <string>

namespace loom {

enum class DeviceType { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool is_cpu() const { return type == DeviceType::kCPU; }
  std::string str() const { return type == DeviceType::kCPU ? "cpu" : "cuda:" + std::to_string(index); }
};

inline Device cpu_device() { return Device{}; }

}  // namespace loom

// JSON parsing for the ckpt layer's file formats (safetensors headers, HF config/index files) that
// reports a key repeated within one object: nlohmann (like Python's json) would silently keep one of the
// two values, and a header or weight_map listing a name twice is exactly what these readers must reject.
#pragma once

#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

namespace loom::ckpt_io {

// Parses `text` (throws nlohmann::json::exception when it is not JSON) and sets *duplicate to the first
// key seen twice within one object, or leaves it empty. One key set per open object.
inline nlohmann::json parse_json_noting_duplicates(const std::string& text, std::string* duplicate) {
  using Json = nlohmann::json;
  std::vector<std::set<std::string>> open_objects;
  duplicate->clear();
  auto on_event = [&](int, Json::parse_event_t ev, Json& parsed) {
    if (ev == Json::parse_event_t::object_start) {
      open_objects.emplace_back();
    } else if (ev == Json::parse_event_t::object_end && !open_objects.empty()) {
      open_objects.pop_back();
    } else if (ev == Json::parse_event_t::key && !open_objects.empty() && duplicate->empty()) {
      std::string k = parsed.get<std::string>();
      if (!open_objects.back().insert(k).second) *duplicate = std::move(k);
    }
    return true;
  };
  return Json::parse(text, on_event);
}

}  // namespace loom::ckpt_io

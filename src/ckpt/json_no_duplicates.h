// JSON parsing for the ckpt layer's file formats (safetensors headers, HF config/index files) that
// reports a key repeated within one object: nlohmann (like Python's json) would silently keep one of the
// two values, and a header or weight_map listing a name twice is exactly what these readers must reject.
// parse_json_strict and shown() are the HF readers' (hf_dir.cpp, hf_config.cpp) entry and error rendering.
#pragma once

#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "loom/core/check.h"

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

// Parses JSON text, rejecting a key repeated within one object and anything but an object at the top
// level. `where` prefixes every error (UserError).
inline nlohmann::json parse_json_strict(const std::string& text, const std::string& where) {
  std::string duplicate;
  nlohmann::json j;
  try {
    j = parse_json_noting_duplicates(text, &duplicate);
  } catch (const nlohmann::json::exception& e) {
    user_error(where, ": not valid JSON: ", e.what());
  }
  if (!duplicate.empty()) user_error(where, ": the key '", duplicate, "' appears twice in one object");
  if (!j.is_object()) user_error(where, ": expected a JSON object at the top level, got ", j.type_name());
  return j;
}

// Short JSON rendering of a bad value for error messages.
inline std::string shown(const nlohmann::json& v) {
  std::string s = v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

}  // namespace loom::ckpt_io

// JSON values of untrusted files in error messages.
#pragma once

#include <cstddef>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace microbatch {

/// A JSON value for an error message, never all of it: a scalar as JSON, cut to max_chars on a
/// UTF-8 boundary; an array or object by its type alone. A damaged or hostile file may hold any
/// value, a dump of which could be megabytes, and dump() recurses once per level of nesting.
inline std::string shown_json(const nlohmann::json& value, std::size_t max_chars = 60) {
  if (value.is_structured()) return fmt::format("a JSON {}", value.type_name());
  std::string text = value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (text.size() <= max_chars) return text;
  std::size_t cut = max_chars;
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;  // whole UTF-8
  return text.substr(0, cut) + "...";
}

}  // namespace microbatch

// Internal to the configuration loader (config.cc): the machinery that walks a JSON object
// against a table of the keys it may hold. Not part of the public API; nlohmann types stay here.
//
// Each section of the file is described once, by a table of KeySpec rows: the key's name, other
// spellings that mean the same thing, whether Strata implements it, and the function that parses
// its value. WalkObject does everything that is common to all sections: it rejects unknown keys
// (suggesting the nearest valid one), records keys Strata accepts but ignores, records deprecated
// spellings, rejects two spellings of one key with different values, and calls each parser with
// the key's full path so that every error names it.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "strata/status.h"

namespace strata::config_internal {

// ordered_json keeps document order, so diagnostics list keys as the user wrote them.
using Json = nlohmann::ordered_json;

// What a parse collects besides the values themselves.
struct ParseState {
  // Every error found: WalkObject records a bad key or value here and goes on with the next, so
  // that one load reports all of a file's mistakes (the caller turns them into one Status).
  std::vector<Status> errors;
  std::vector<std::string> ignored_keys;
  std::vector<std::string> auto_keys;
  std::vector<std::string> deprecated_keys;
};

// One value found in the document and where it was found.
struct Field {
  const Json& value;
  std::string path;   // full key path, e.g. "zero_optimization.offload_param.device"
  ParseState* state;  // never null
};

enum class Support {
  kImplemented,  // parsed and used
  kIgnored,      // a DeepSpeed key Strata accepts without effect: listed in ignored_keys
};

// One row of a section's table. Values are parsed in document order, so diagnostics list keys
// as the user wrote them; a section whose rows depend on each other (optimizer "params" on
// "type") reads the row it depends on before walking.
struct KeySpec {
  std::string_view name;
  Support support = Support::kImplemented;
  // Called once with the value (never with JSON null, which counts as absent). Null for kIgnored.
  std::function<Status(const Field&)> parse;
  // Other spellings with the same meaning. Several spellings may be given if their values are
  // equal; different values are an error.
  std::vector<std::string_view> aliases = {};
  // Spellings that are also accepted but recorded in deprecated_keys.
  std::vector<std::string_view> deprecated_aliases = {};
  // Non-empty when the key itself is deprecated; names what replaces it.
  std::string_view deprecated_by = {};
};

// A row for a DeepSpeed key that Strata accepts and ignores.
KeySpec Ignored(std::string_view name, std::vector<std::string_view> aliases = {});

// Walks `object` (which must be a JSON object) against `specs`. Errors name the full key path.
// An unknown key, or a value its parser refuses, is recorded in object.state->errors and the
// walk goes on; only `object` not being an object is returned.
Status WalkObject(const Field& object, const std::vector<KeySpec>& specs);

// "<path>: expected <expected>, got <value>" as InvalidArgument.
Status ValueError(const Field& field, std::string_view expected);
// "<path>: <message>" with the given code.
Status FieldError(const Field& field, StatusCode code, std::string_view message);

// A short rendering of a JSON value for messages: strings quoted, long values shortened.
std::string Describe(const Json& value);

// "a.b" + "c" -> "a.b.c"; "" + "c" -> "c".
std::string JoinPath(std::string_view parent, std::string_view key);

// True when the value is the string "auto" (any case); records the field in auto_keys. Every
// reader below calls it first and leaves its output untouched for "auto" (the default stands).
bool TakeAuto(const Field& field);

// Readers. On success they store the value; on a type or range error they return ValueError
// with `expected` describing what is allowed (e.g. "a positive integer").
Status ReadBool(const Field& field, bool* out);  // true/false, or the strings "true"/"false"
// An integral JSON number (5e8 is accepted; 1.5 is not) within [min, max].
Status ReadInt64(const Field& field, int64_t min, int64_t max, std::string_view expected,
                 int64_t* out);
Status ReadInt(const Field& field, int min, int max, std::string_view expected, int* out);
// A finite JSON number within [min, max].
Status ReadDouble(const Field& field, double min, double max, std::string_view expected,
                  double* out);
// A byte count: an integral number, or a string ParseByteSize accepts ("64GiB", "1e9").
// Must be >= min and a multiple of `multiple` (1 for any).
Status ReadBytes(const Field& field, uint64_t min, uint64_t multiple, std::string_view expected,
                 uint64_t* out);
// A non-empty string.
Status ReadString(const Field& field, std::string_view expected, std::string* out);
// A non-empty array of non-empty strings (a single string is taken as a list of one).
Status ReadStringList(const Field& field, std::string_view expected, std::vector<std::string>* out);

template <typename E>
struct EnumName {
  std::string_view name;
  E value;
};

// A string matching one of `names` (case-insensitive). The first name listed for a value is
// the one shown in messages; later ones are accepted synonyms.
template <typename E>
Status ReadEnum(const Field& field, std::initializer_list<EnumName<E>> names, E* out);

// Distance between two keys for "did you mean" (case-insensitive optimal string alignment).
int KeyDistance(std::string_view a, std::string_view b);

// --- template implementation ---

std::optional<size_t> MatchName(const Json& value, const std::vector<std::string_view>& names);
std::string QuotedList(const std::vector<std::string_view>& names);

template <typename E>
Status ReadEnum(const Field& field, std::initializer_list<EnumName<E>> names, E* out) {
  if (TakeAuto(field)) return Status::Ok();
  std::vector<std::string_view> spellings;
  std::vector<std::string_view> shown;
  std::vector<E> seen;
  for (const auto& n : names) {
    spellings.push_back(n.name);
    bool first = true;
    for (const E& v : seen)
      first = first && v != n.value;
    if (first) {
      seen.push_back(n.value);
      shown.push_back(n.name);
    }
  }
  std::optional<size_t> index = MatchName(field.value, spellings);
  if (!index) return ValueError(field, "one of " + QuotedList(shown));
  *out = (names.begin() + *index)->value;
  return Status::Ok();
}

}  // namespace strata::config_internal

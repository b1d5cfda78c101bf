#include "common/config_schema.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>

#include "common/units.h"

namespace strata::config_internal {

namespace {

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out)
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  return a.size() == b.size() && Lower(a) == Lower(b);
}

// The integral value of a JSON number, if it has one that fits in int64_t.
std::optional<int64_t> AsInteger(const Json& value) {
  if (value.is_number_unsigned()) {
    uint64_t u = value.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (value.is_number_integer()) return value.get<int64_t>();
  if (value.is_number_float()) {
    // Configs write large counts as 5e8, which JSON parsers read as floating point.
    double d = value.get<double>();
    constexpr double kLimit = 9223372036854775808.0;  // 2^63
    if (!std::isfinite(d) || d != std::floor(d) || d < -kLimit || d >= kLimit) return std::nullopt;
    return static_cast<int64_t>(d);
  }
  return std::nullopt;
}

// How far a key may be from a valid one and still be offered as "did you mean".
int SuggestionThreshold(std::string_view key) {
  return std::clamp(static_cast<int>(key.size()) / 4, 1, 3);
}

Status UnknownKey(const std::string& path, std::string_view key,
                  const std::vector<KeySpec>& specs) {
  std::string_view best;
  int best_distance = std::numeric_limits<int>::max();
  auto consider = [&](std::string_view candidate) {
    int d = KeyDistance(key, candidate);
    if (d < best_distance) {
      best_distance = d;
      best = candidate;
    }
  };
  for (const KeySpec& spec : specs) {
    consider(spec.name);
    for (std::string_view a : spec.aliases)
      consider(a);
    for (std::string_view a : spec.deprecated_aliases)
      consider(a);
  }
  if (!best.empty() && best_distance <= SuggestionThreshold(key)) {
    return InvalidArgumentError(fmt::format("{}: unknown key; did you mean '{}'?", path, best));
  }
  std::vector<std::string_view> valid;
  for (const KeySpec& spec : specs) {
    if (spec.support == Support::kImplemented && spec.deprecated_by.empty()) {
      valid.push_back(spec.name);
    }
  }
  return InvalidArgumentError(
      fmt::format("{}: unknown key; valid keys here are: {}", path, fmt::join(valid, ", ")));
}

}  // namespace

KeySpec Ignored(std::string_view name, std::vector<std::string_view> aliases) {
  KeySpec spec;
  spec.name = name;
  spec.support = Support::kIgnored;
  spec.aliases = std::move(aliases);
  return spec;
}

std::string JoinPath(std::string_view parent, std::string_view key) {
  if (parent.empty()) return std::string(key);
  return fmt::format("{}.{}", parent, key);
}

std::string Describe(const Json& value) {
  constexpr size_t kMax = 60;
  std::string text = value.dump();
  if (text.size() > kMax) text = text.substr(0, kMax - 3) + "...";
  return text;
}

Status ValueError(const Field& field, std::string_view expected) {
  return InvalidArgumentError(
      fmt::format("{}: expected {}, got {}", field.path, expected, Describe(field.value)));
}

Status FieldError(const Field& field, StatusCode code, std::string_view message) {
  return Status(code, fmt::format("{}: {}", field.path, message));
}

bool TakeAuto(const Field& field) {
  if (!field.value.is_string() ||
      !EqualsIgnoreCase(field.value.get_ref<const std::string&>(), "auto")) {
    return false;
  }
  field.state->auto_keys.push_back(field.path);
  return true;
}

Status ReadBool(const Field& field, bool* out) {
  if (TakeAuto(field)) return Status::Ok();
  if (field.value.is_boolean()) {
    *out = field.value.get<bool>();
    return Status::Ok();
  }
  if (field.value.is_string()) {
    const std::string& s = field.value.get_ref<const std::string&>();
    if (EqualsIgnoreCase(s, "true") || EqualsIgnoreCase(s, "false")) {
      *out = EqualsIgnoreCase(s, "true");
      return Status::Ok();
    }
  }
  return ValueError(field, "true or false");
}

Status ReadInt64(const Field& field, int64_t min, int64_t max, std::string_view expected,
                 int64_t* out) {
  if (TakeAuto(field)) return Status::Ok();
  std::optional<int64_t> v = AsInteger(field.value);
  if (!v || *v < min || *v > max) return ValueError(field, expected);
  *out = *v;
  return Status::Ok();
}

Status ReadInt(const Field& field, int min, int max, std::string_view expected, int* out) {
  int64_t v = *out;
  STRATA_RETURN_IF_ERROR(ReadInt64(field, min, max, expected, &v));
  *out = static_cast<int>(v);
  return Status::Ok();
}

Status ReadDouble(const Field& field, double min, double max, std::string_view expected,
                  double* out) {
  if (TakeAuto(field)) return Status::Ok();
  if (!field.value.is_number()) return ValueError(field, expected);
  double v = field.value.get<double>();
  if (!std::isfinite(v) || v < min || v > max) return ValueError(field, expected);
  *out = v;
  return Status::Ok();
}

Status ReadBytes(const Field& field, uint64_t min, uint64_t multiple, std::string_view expected,
                 uint64_t* out) {
  if (TakeAuto(field)) return Status::Ok();
  uint64_t bytes = 0;
  if (field.value.is_string()) {
    Result<uint64_t> parsed = ParseByteSize(field.value.get_ref<const std::string&>());
    if (!parsed.ok()) {
      return FieldError(field, StatusCode::kInvalidArgument, parsed.status().message());
    }
    bytes = *parsed;
  } else {
    std::optional<int64_t> v = AsInteger(field.value);
    if (!v || *v < 0) return ValueError(field, expected);
    bytes = static_cast<uint64_t>(*v);
  }
  if (bytes < min || (multiple > 1 && bytes % multiple != 0)) return ValueError(field, expected);
  *out = bytes;
  return Status::Ok();
}

Status ReadString(const Field& field, std::string_view expected, std::string* out) {
  if (TakeAuto(field)) return Status::Ok();
  if (!field.value.is_string() || field.value.get_ref<const std::string&>().empty()) {
    return ValueError(field, expected);
  }
  *out = field.value.get<std::string>();
  return Status::Ok();
}

Status ReadStringList(const Field& field, std::string_view expected,
                      std::vector<std::string>* out) {
  if (TakeAuto(field)) return Status::Ok();
  std::vector<std::string> list;
  if (field.value.is_string()) {
    list.push_back(field.value.get<std::string>());
  } else if (field.value.is_array()) {
    for (const Json& item : field.value) {
      if (!item.is_string()) return ValueError(field, expected);
      list.push_back(item.get<std::string>());
    }
  } else {
    return ValueError(field, expected);
  }
  if (list.empty()) return ValueError(field, expected);
  for (const std::string& s : list) {
    if (s.empty()) return ValueError(field, expected);
  }
  *out = std::move(list);
  return Status::Ok();
}

std::optional<size_t> MatchName(const Json& value, const std::vector<std::string_view>& names) {
  if (!value.is_string()) return std::nullopt;
  const std::string& s = value.get_ref<const std::string&>();
  for (size_t i = 0; i < names.size(); ++i) {
    if (EqualsIgnoreCase(s, names[i])) return i;
  }
  return std::nullopt;
}

std::string QuotedList(const std::vector<std::string_view>& names) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += (i + 1 == names.size()) ? " or " : ", ";
    out += fmt::format("\"{}\"", names[i]);
  }
  return out;
}

int KeyDistance(std::string_view a_in, std::string_view b_in) {
  // Optimal string alignment: Levenshtein plus adjacent transpositions ("trian" -> "train").
  const std::string a = Lower(a_in);
  const std::string b = Lower(b_in);
  const size_t n = a.size();
  const size_t m = b.size();
  std::vector<std::vector<int>> d(n + 1, std::vector<int>(m + 1, 0));
  for (size_t i = 0; i <= n; ++i)
    d[i][0] = static_cast<int>(i);
  for (size_t j = 0; j <= m; ++j)
    d[0][j] = static_cast<int>(j);
  for (size_t i = 1; i <= n; ++i) {
    for (size_t j = 1; j <= m; ++j) {
      int cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[n][m];
}

Status WalkObject(const Field& object, const std::vector<KeySpec>& specs) {
  if (!object.value.is_object()) return ValueError(object, "an object");

  // Pass 1, in document order: classify every key. Values are collected per row so that
  // several spellings of one key can be compared before anything is parsed.
  struct Found {
    std::string_view spelling;
    const Json* value;
  };
  std::vector<std::vector<Found>> found(specs.size());
  std::vector<size_t> order;  // rows in the order their first spelling appears
  for (auto it = object.value.begin(); it != object.value.end(); ++it) {
    const std::string& key = it.key();
    const std::string path = JoinPath(object.path, key);
    const KeySpec* spec = nullptr;
    bool deprecated_spelling = false;
    size_t index = 0;
    for (; index < specs.size() && spec == nullptr; ++index) {
      const KeySpec& s = specs[index];
      if (key == s.name || std::find(s.aliases.begin(), s.aliases.end(), key) != s.aliases.end()) {
        spec = &s;
      } else if (std::find(s.deprecated_aliases.begin(), s.deprecated_aliases.end(), key) !=
                 s.deprecated_aliases.end()) {
        spec = &s;
        deprecated_spelling = true;
      }
    }
    if (spec == nullptr) {
      object.state->errors.push_back(UnknownKey(path, key, specs));
      continue;
    }
    --index;
    if (it.value().is_null()) continue;  // null means "not given", as in DeepSpeed
    if (spec->support == Support::kIgnored) {
      object.state->ignored_keys.push_back(path);
      continue;
    }
    if (deprecated_spelling) {
      object.state->deprecated_keys.push_back(
          fmt::format("{} (now '{}')", path, JoinPath(object.path, spec->name)));
    } else if (!spec->deprecated_by.empty()) {
      object.state->deprecated_keys.push_back(
          fmt::format("{} (now '{}')", path, JoinPath(object.path, spec->deprecated_by)));
    }
    if (found[index].empty()) order.push_back(index);
    found[index].push_back({it.key(), &it.value()});
  }

  // Pass 2, in document order: parse.
  for (size_t i : order) {
    const Found& first = found[i].front();
    for (const Found& other : found[i]) {
      if (*other.value != *first.value) {
        object.state->errors.push_back(InvalidArgumentError(fmt::format(
            "{}: given with different values as '{}' ({}) and '{}' ({}); these spellings name "
            "the same setting",
            JoinPath(object.path, specs[i].name), first.spelling, Describe(*first.value),
            other.spelling, Describe(*other.value))));
        break;
      }
    }
    Field field{*first.value, JoinPath(object.path, first.spelling), object.state};
    if (Status st = specs[i].parse(field); !st.ok()) object.state->errors.push_back(std::move(st));
  }
  return Status::Ok();
}

}  // namespace strata::config_internal

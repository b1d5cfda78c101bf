// Reading the small text files of /proc and /sys: one value per file ("254\n"), or a list with the
// active choice in brackets ("always [madvise] never"). Header-only; used by the system-facts
// code (host memory, path info, io_uring probe, `strata env`).
//
// These functions never fail loudly: a file that is absent or unreadable is "unknown"
// (std::nullopt), which is how the kernel says a feature does not exist here.
//
// Thread safety: all functions are reentrant.
#pragma once

#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>

namespace strata::procfs {

// The whole content of a small file (at most `max_bytes`), or nullopt when it cannot be read.
inline std::optional<std::string> ReadSmallFile(const std::string& path,
                                                size_t max_bytes = 1 << 20) {
  std::FILE* f = std::fopen(path.c_str(), "re");
  if (f == nullptr) return std::nullopt;
  std::string out;
  char buf[4096];
  bool ok = true;
  while (out.size() < max_bytes) {
    size_t n = std::fread(buf, 1, sizeof(buf), f);
    out.append(buf, n);
    if (n < sizeof(buf)) {
      ok = std::ferror(f) == 0;
      break;
    }
  }
  std::fclose(f);
  if (!ok) return std::nullopt;
  if (out.size() > max_bytes) out.resize(max_bytes);
  return out;
}

// `text` without leading and trailing whitespace.
inline std::string_view Trim(std::string_view text) {
  constexpr std::string_view kSpace = " \t\r\n";
  size_t begin = text.find_first_not_of(kSpace);
  if (begin == std::string_view::npos) return {};
  size_t end = text.find_last_not_of(kSpace);
  return text.substr(begin, end - begin + 1);
}

// Parses a whole unsigned decimal number (surrounding whitespace allowed).
inline std::optional<uint64_t> ParseUint(std::string_view text) {
  text = Trim(text);
  if (text.empty()) return std::nullopt;
  uint64_t value = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || ptr != text.data() + text.size()) return std::nullopt;
  return value;
}

// The file's content as an unsigned decimal number ("254\n" -> 254).
inline std::optional<uint64_t> ReadUintFile(const std::string& path) {
  auto text = ReadSmallFile(path, 4096);
  if (!text) return std::nullopt;
  return ParseUint(*text);
}

// The file's content without surrounding whitespace.
inline std::optional<std::string> ReadTrimmedFile(const std::string& path) {
  auto text = ReadSmallFile(path, 64 * 1024);
  if (!text) return std::nullopt;
  return std::string(Trim(*text));
}

// The bracketed word of a sysfs choice list ("none [mq-deadline] kyber" -> "mq-deadline"). A list
// of one word without brackets ("none") is that word. nullopt when nothing is marked.
inline std::optional<std::string> ActiveChoice(std::string_view text) {
  size_t open = text.find('[');
  if (open != std::string_view::npos) {
    size_t close = text.find(']', open);
    if (close == std::string_view::npos) return std::nullopt;
    return std::string(text.substr(open + 1, close - open - 1));
  }
  text = Trim(text);
  if (text.empty() || text.find(' ') != std::string_view::npos) return std::nullopt;
  return std::string(text);
}

// The lines of a text, without their newlines, for a range-for:
//   for (std::string_view line : Lines(text)) { ... }
// `text` must outlive the loop.
class Lines {
 public:
  explicit Lines(std::string_view text) : text_(text) {}

  class iterator {
   public:
    iterator(std::string_view text, size_t pos) : text_(text), pos_(pos) { Find(); }
    std::string_view operator*() const { return text_.substr(pos_, eol_ - pos_); }
    iterator& operator++() {
      pos_ = eol_ + 1;
      Find();
      return *this;
    }
    bool operator!=(const iterator& other) const { return pos_ != other.pos_; }

   private:
    void Find() {
      if (pos_ >= text_.size()) {
        pos_ = text_.size();
        eol_ = pos_;
        return;
      }
      eol_ = text_.find('\n', pos_);
      if (eol_ == std::string_view::npos) eol_ = text_.size();
    }
    std::string_view text_;
    size_t pos_;
    size_t eol_ = 0;
  };

  iterator begin() const { return iterator(text_, 0); }
  iterator end() const { return iterator(text_, text_.size()); }

 private:
  std::string_view text_;
};

// The value of "Key:   123 kB" in a /proc/meminfo-style text, in the file's units (no scaling).
inline std::optional<uint64_t> MeminfoField(std::string_view text, std::string_view key) {
  for (std::string_view line : Lines(text)) {
    if (line.size() > key.size() && line.substr(0, key.size()) == key && line[key.size()] == ':') {
      std::string_view rest = Trim(line.substr(key.size() + 1));
      size_t space = rest.find(' ');
      return ParseUint(rest.substr(0, space));
    }
  }
  return std::nullopt;
}

}  // namespace strata::procfs

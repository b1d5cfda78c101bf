#include "train/report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "common/units.h"
#include "strata/file_system.h"

namespace strata::train {
namespace {

struct Series {
  std::string name;
  std::string color;
  std::vector<std::pair<double, double>> points;  // (step, value)
};

enum class Unit { kPlain, kBytes, kSeconds };

std::string Escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string Label(double v, Unit unit) {
  switch (unit) {
    case Unit::kBytes:
      return FormatBytes(static_cast<uint64_t>(std::max(0.0, v)));
    case Unit::kSeconds:
      return v < 1.0 ? fmt::format("{:.3g} ms", v * 1e3) : fmt::format("{:.3g} s", v);
    case Unit::kPlain:
      break;
  }
  const double a = std::abs(v);
  if (a >= 1e9) return fmt::format("{:.3g}G", v / 1e9);
  if (a >= 1e6) return fmt::format("{:.3g}M", v / 1e6);
  if (a >= 1e4) return fmt::format("{:.3g}k", v / 1e3);
  return fmt::format("{:.4g}", v);
}

// A step of 1, 2 or 5 times a power of ten giving about `n` intervals over [lo, hi].
double NiceStep(double lo, double hi, int n) {
  const double raw = (hi - lo) / n;
  if (!(raw > 0)) return 1.0;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (m * p >= raw) return m * p;
  }
  return 10 * p;
}

constexpr int kWidth = 760, kHeight = 260, kLeft = 78, kRight = 150, kTop = 14, kBottom = 36;

struct Frame {
  double x0, x1, y0, y1;
  double X(double x) const {
    return kLeft + (x1 > x0 ? (x - x0) / (x1 - x0) : 0.5) * (kWidth - kLeft - kRight);
  }
  double Y(double y) const {
    return kTop + (1.0 - (y1 > y0 ? (y - y0) / (y1 - y0) : 0.5)) * (kHeight - kTop - kBottom);
  }
};

// The axes, grid, tick labels and legend of a chart; `svg` gets the plot drawn into `frame`.
std::string Chart(const std::string& title, const std::string& y_label, Unit unit, Frame f,
                  const std::vector<Series>& legend, const std::string& plot) {
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" role=\"img\" "
      "aria-label=\"{}\"><rect width=\"100%\" height=\"100%\" fill=\"#fff\"/>",
      kWidth, kHeight, Escape(title));
  const double ystep = NiceStep(f.y0, f.y1, 5);
  for (double y = std::ceil(f.y0 / ystep) * ystep; y <= f.y1 + ystep * 1e-9; y += ystep) {
    svg += fmt::format(
        "<line x1=\"{}\" x2=\"{}\" y1=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#e3e3e3\"/>"
        "<text x=\"{}\" y=\"{:.1f}\" font-size=\"11\" text-anchor=\"end\">{}</text>",
        kLeft, kWidth - kRight, f.Y(y), f.Y(y), kLeft - 6, f.Y(y) + 4, Escape(Label(y, unit)));
  }
  const double xstep = std::max(1.0, NiceStep(f.x0, f.x1, 8));
  for (double x = std::ceil(f.x0 / xstep) * xstep; x <= f.x1 + 1e-9; x += xstep) {
    svg +=
        fmt::format("<text x=\"{:.1f}\" y=\"{}\" font-size=\"11\" text-anchor=\"middle\">{}</text>",
                    f.X(x), kHeight - kBottom + 16, Label(x, Unit::kPlain));
  }
  svg += fmt::format(
      "<line x1=\"{0}\" x2=\"{0}\" y1=\"{1}\" y2=\"{2}\" stroke=\"#555\"/>"
      "<line x1=\"{0}\" x2=\"{3}\" y1=\"{2}\" y2=\"{2}\" stroke=\"#555\"/>"
      "<text x=\"{4}\" y=\"{5}\" font-size=\"11\" text-anchor=\"middle\">step</text>"
      "<text x=\"14\" y=\"{6}\" font-size=\"11\" text-anchor=\"middle\" "
      "transform=\"rotate(-90 14 {6})\">{7}</text>",
      kLeft, kTop, kHeight - kBottom, kWidth - kRight, (kLeft + kWidth - kRight) / 2, kHeight - 4,
      (kTop + kHeight - kBottom) / 2, Escape(y_label));
  svg += plot;
  for (size_t i = 0; i < legend.size(); ++i) {
    const int y = kTop + 8 + static_cast<int>(i) * 18;
    svg += fmt::format(
        "<rect x=\"{}\" y=\"{}\" width=\"12\" height=\"12\" fill=\"{}\"/>"
        "<text x=\"{}\" y=\"{}\" font-size=\"12\">{}</text>",
        kWidth - kRight + 12, y - 10, legend[i].color, kWidth - kRight + 30, y,
        Escape(legend[i].name));
  }
  return svg + "</svg>";
}

Frame Bounds(const std::vector<Series>& series, bool from_zero) {
  Frame f{1e300, -1e300, from_zero ? 0.0 : 1e300, -1e300};
  for (const Series& s : series) {
    for (const auto& [x, y] : s.points) {
      f.x0 = std::min(f.x0, x);
      f.x1 = std::max(f.x1, x);
      f.y0 = std::min(f.y0, y);
      f.y1 = std::max(f.y1, y);
    }
  }
  if (f.y1 <= f.y0) f.y1 = f.y0 + 1.0;
  const double pad = (f.y1 - f.y0) * 0.05;
  if (!from_zero) f.y0 -= pad;
  f.y1 += pad;
  return f;
}

std::string LineChart(const std::string& title, const std::string& y_label, Unit unit,
                      const std::vector<Series>& series, bool from_zero) {
  const Frame f = Bounds(series, from_zero);
  std::string plot;
  for (const Series& s : series) {
    std::string pts;
    for (const auto& [x, y] : s.points)
      pts += fmt::format("{:.1f},{:.1f} ", f.X(x), f.Y(y));
    plot += fmt::format("<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"2\" points=\"{}\"/>",
                        s.color, pts);
    if (s.points.size() <= 40) {
      for (const auto& [x, y] : s.points) {
        plot += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"2.5\" fill=\"{}\"/>", f.X(x),
                            f.Y(y), s.color);
      }
    }
  }
  return Chart(title, y_label, unit, f, series, plot);
}

// Bars per step, the series stacked in order.
std::string StackedBars(const std::string& title, const std::string& y_label, Unit unit,
                        const std::vector<Series>& layers) {
  std::map<double, double> totals;
  for (const Series& s : layers) {
    for (const auto& [x, y] : s.points)
      totals[x] += std::max(0.0, y);
  }
  Series all{"", "", {totals.begin(), totals.end()}};
  Frame f = Bounds({all}, true);
  const double n = std::max<double>(1.0, static_cast<double>(totals.size()));
  f.x0 -= 0.5;
  f.x1 += 0.5;
  const double bar = std::max(1.0, 0.8 * (kWidth - kLeft - kRight) / n);
  std::map<double, double> base;
  std::string plot;
  for (const Series& s : layers) {
    for (const auto& [x, y] : s.points) {
      const double b = base[x], top = b + std::max(0.0, y);
      plot += fmt::format(
          "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"{}\"/>",
          f.X(x) - bar / 2, f.Y(top), bar, std::max(0.0, f.Y(b) - f.Y(top)), s.color);
      base[x] = top;
    }
  }
  return Chart(title, y_label, unit, f, layers, plot);
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

using MetricSteps = std::map<double, nlohmann::json>;  // step -> its metrics row

// The metrics file's steps by step number; a resumed run appends, so the last row of a step wins.
Result<MetricSteps> ReadMetricSteps(const std::string& path) {
  Result<std::string> metrics_text = ReadFileToString(LocalFileSystem(), path);
  if (!metrics_text.ok()) {
    return InvalidArgumentError(fmt::format("{}: cannot open the metrics file", path));
  }
  std::istringstream in(*metrics_text);
  std::vector<nlohmann::json> rows;
  int line_no = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object() || !j.contains("step") || !j["step"].is_number()) {
      return InvalidArgumentError(fmt::format(
          "{}:{}: not a step of strata train --metrics (one JSON object with \"step\" per line)",
          path, line_no));
    }
    rows.push_back(std::move(j));
  }
  if (rows.empty()) {
    return InvalidArgumentError(fmt::format("{}: no steps in the metrics file", path));
  }
  std::map<double, nlohmann::json> by_step;
  for (auto& r : rows) {
    const double step = r["step"].get<double>();  // before r is moved from
    by_step[step] = std::move(r);
  }
  return by_step;
}

// The trace's 20 longest span names, summed over every thread, as an HTML section.
Result<std::string> TraceSection(const std::string& trace_path) {
  const Result<std::string> t = ReadFileToString(LocalFileSystem(), trace_path);
  const nlohmann::json trace = t.ok()
                                   ? nlohmann::json::parse(*t, nullptr, /*allow_exceptions=*/false)
                                   : nlohmann::json(nlohmann::json::value_t::discarded);
  if (trace.is_discarded()) {
    return InvalidArgumentError(
        fmt::format("{}: not a Chrome trace (strata train --trace writes one)", trace_path));
  }
  const nlohmann::json& events = trace.is_array() ? trace : trace.value("traceEvents", trace);
  std::map<std::string, std::pair<int64_t, double>> spans;  // name -> calls, microseconds
  for (const auto& e : events) {
    if (e.is_object() && e.value("ph", "") == "X" && e.contains("dur") && e["dur"].is_number()) {
      auto& s = spans[e.value("name", "?")];
      ++s.first;
      s.second += e["dur"].get<double>();
    }
  }
  std::vector<std::pair<std::string, std::pair<int64_t, double>>> top(spans.begin(), spans.end());
  std::sort(top.begin(), top.end(),
            [](const auto& a, const auto& b) { return a.second.second > b.second.second; });
  if (top.size() > 20) top.resize(20);
  std::string html = fmt::format(
      "<h2>Trace: time by span</h2>\n<p class=\"note\">From {}: the 20 "
      "longest span names, summed over every thread.</p>\n<table><tr><th>span"
      "</th><th>count</th><th>total</th></tr>",
      Escape(trace_path));
  for (const auto& [name, s] : top) {
    html += fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td></tr>", Escape(name), s.first,
                        Escape(Label(s.second * 1e-6, Unit::kSeconds)));
  }
  html += "</table>\n";
  return html;
}

}  // namespace

Result<std::string> RenderReport(const ReportOptions& o) {
  STRATA_ASSIGN_OR_RETURN(const MetricSteps by_step, ReadMetricSteps(o.metrics_path));

  auto series = [&](const char* key, const std::string& name, const std::string& color,
                    double scale = 1.0) {
    Series s{name, color, {}};
    for (const auto& [step, r] : by_step) {
      if (r.contains(key) && r[key].is_number()) {
        s.points.emplace_back(step, r[key].get<double>() * scale);
      }
    }
    return s;
  };

  const std::string title = o.title.empty() ? "Strata training report" : o.title;
  std::string html = fmt::format(
      "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{}</title>\n"
      "<style>body{{font-family:sans-serif;margin:24px;color:#222;max-width:820px}}"
      "h2{{font-size:17px;margin:26px 0 6px}}table{{border-collapse:collapse;font-size:13px}}"
      "td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}"
      "th{{background:#f3f3f3}}td:first-child,th:first-child{{text-align:left}}"
      "p.note{{font-size:12px;color:#555}}</style></head><body>\n<h1>{}</h1>\n"
      "<p class=\"note\">From {} ({} steps).</p>\n",
      Escape(title), Escape(title), Escape(o.metrics_path), by_step.size());

  // Summary.
  std::vector<double> tok, step_s;
  for (const auto& [s, r] : by_step) {
    if (r.contains("tokens_per_s") && r["tokens_per_s"].is_number()) {
      tok.push_back(r["tokens_per_s"].get<double>());
    }
    if (r.contains("step_s") && r["step_s"].is_number())
      step_s.push_back(r["step_s"].get<double>());
  }
  const nlohmann::json& first = by_step.begin()->second;
  const nlohmann::json& last = by_step.rbegin()->second;
  auto num = [](const nlohmann::json& r, const char* k) {
    return r.contains(k) && r[k].is_number() ? fmt::format("{:.4f}", r[k].get<double>())
                                             : std::string("-");
  };
  html += "<h2>Summary</h2>\n<table><tr><th>what</th><th>value</th></tr>";
  html += fmt::format("<tr><td>steps</td><td>{} to {}</td></tr>",
                      static_cast<int64_t>(by_step.begin()->first),
                      static_cast<int64_t>(by_step.rbegin()->first));
  html += fmt::format("<tr><td>loss, first and last step</td><td>{} &rarr; {}</td></tr>",
                      num(first, "loss"), num(last, "loss"));
  if (last.contains("eval_loss")) {
    html +=
        fmt::format("<tr><td>last evaluation loss</td><td>{}</td></tr>", num(last, "eval_loss"));
  }
  html += fmt::format("<tr><td>median tokens/s</td><td>{:.0f}</td></tr>", Median(tok));
  html += fmt::format("<tr><td>median step time</td><td>{}</td></tr>",
                      Escape(Label(Median(step_s), Unit::kSeconds)));
  html += "</table>\n";

  html += "<h2>Loss</h2>\n";
  std::vector<Series> loss = {series("loss", "train loss", "#1f77b4")};
  Series eval = series("eval_loss", "eval loss", "#d62728");
  if (!eval.points.empty()) loss.push_back(eval);
  html += LineChart("Loss", "loss", Unit::kPlain, loss, false) + "\n";

  html += "<h2>Tokens per second</h2>\n";
  html += LineChart("Tokens per second", "tokens/s", Unit::kPlain,
                    {series("tokens_per_s", "tokens/s", "#2ca02c")}, true) +
          "\n";

  html +=
      "<h2>Step time split</h2>\n<p class=\"note\">Each step's time: compute, and what the "
      "engine could not hide behind it (exposed communication, I/O and optimizer).</p>\n";
  html += StackedBars("Step time split", "seconds", Unit::kSeconds,
                      {series("compute_s", "compute", "#1f77b4"),
                       series("exposed_comm_s", "communication", "#ff7f0e"),
                       series("exposed_io_s", "I/O", "#9467bd"),
                       series("exposed_optimizer_s", "optimizer", "#8c564b")}) +
          "\n";

  html += "<h2>NVMe bytes per step</h2>\n";
  const std::vector<Series> nvme = {series("nvme_read_bytes", "read", "#17becf"),
                                    series("nvme_write_bytes", "written", "#e377c2")};
  bool any_nvme = false;
  for (const Series& s : nvme) {
    for (const auto& p : s.points)
      any_nvme = any_nvme || p.second > 0;
  }
  html += any_nvme ? LineChart("NVMe bytes per step", "bytes", Unit::kBytes, nvme, true) + "\n"
                   : std::string(
                         "<p class=\"note\">No NVMe traffic in this run (nothing "
                         "offloaded to NVMe).</p>\n");

  html +=
      "<h2>Peak memory per tier</h2>\n<p class=\"note\">Device: what the device allocator "
      "held at most (on the CPU device, its budgeted memory); host: the pinned pool's peak."
      "</p>\n";
  html += LineChart("Peak memory per tier", "bytes", Unit::kBytes,
                    {series("device_peak_bytes", "device", "#1f77b4"),
                     series("host_peak_bytes", "pinned host", "#ff7f0e")},
                    true) +
          "\n";

  if (!o.trace_path.empty()) {
    STRATA_ASSIGN_OR_RETURN(const std::string section, TraceSection(o.trace_path));
    html += section;
  }
  html += "</body></html>\n";
  return html;
}

Status WriteReport(const ReportOptions& options, const std::string& out_path) {
  STRATA_ASSIGN_OR_RETURN(const std::string html, RenderReport(options));
  Status st = WriteFileAtomic(LocalFileSystem(), out_path, html);
  if (!st.ok()) return st.WithContext("report");
  return Status::Ok();
}

}  // namespace strata::train

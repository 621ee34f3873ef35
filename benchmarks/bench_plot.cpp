// flatshard/benchmarks/bench_plot.cpp — see bench_plot.h for the contract.
#include "benchmarks/bench_plot.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "support/output_file.h"

namespace flatshard {
namespace bench {

namespace {

constexpr double kWidth = 960, kPanelHeight = 330, kLeft = 90, kRight = 30, kTop = 70,
                 kBottom = 70;

std::string xml(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string num(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}

// Digits after the point that make values around `v` readable (1234 -> 0, 12.3 -> 1, 0.12 -> 2).
int digits_for(double v) { return v >= 100 ? 0 : v >= 10 ? 1 : 2; }

// A "nice" tick step (1, 2 or 5 times a power of ten) giving about `ticks` intervals up to max.
double nice_step(double max, int ticks) {
  if (!(max > 0)) return 1;
  const double raw = max / ticks;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * p >= raw) return m * p;
  return 10 * p;
}

std::string shorten(const std::string& s, size_t max_chars) {
  return s.size() <= max_chars ? s : s.substr(0, max_chars - 1) + "\xE2\x80\xA6";  // "…"
}

struct Bar {
  std::string label;
  double value;
  double lo, hi;  // whisker; lo == hi: none
};

void panel(std::ostringstream& svg, double y0, const std::string& title,
           const std::string& y_label, const std::string& color, const std::vector<Bar>& bars) {
  const double plot_w = kWidth - kLeft - kRight;
  const double plot_h = kPanelHeight - kTop - kBottom;
  const double base = y0 + kTop + plot_h;
  double max = 0;
  for (const auto& b : bars) max = std::max({max, b.value, b.hi});
  const double step = nice_step(max, 5);
  const double top = std::max(step, std::ceil(max / step) * step);
  auto y_of = [&](double v) { return base - plot_h * v / top; };

  svg << "<text x=\"" << kWidth / 2 << "\" y=\"" << y0 + 30
      << "\" text-anchor=\"middle\" font-size=\"16\" font-weight=\"bold\">" << xml(title)
      << "</text>\n";
  // y axis: grid lines with tick values, and its label rotated along it.
  const int tick_digits = step >= 1 ? 0 : step >= 0.1 ? 1 : 2;  // steps are 1, 2, 5 x 10^k
  for (double v = 0; v <= top + step / 2; v += step) {
    const double y = y_of(v);
    svg << "<line x1=\"" << kLeft << "\" y1=\"" << y << "\" x2=\"" << kWidth - kRight
        << "\" y2=\"" << y << "\" stroke=\"#ddd\"/>\n"
        << "<text x=\"" << kLeft - 8 << "\" y=\"" << y + 4
        << "\" text-anchor=\"end\" font-size=\"11\">" << num(v, tick_digits) << "</text>\n";
  }
  svg << "<line x1=\"" << kLeft << "\" y1=\"" << y0 + kTop << "\" x2=\"" << kLeft << "\" y2=\""
      << base << "\" stroke=\"#333\"/>\n"
      << "<line x1=\"" << kLeft << "\" y1=\"" << base << "\" x2=\"" << kWidth - kRight
      << "\" y2=\"" << base << "\" stroke=\"#333\"/>\n"
      << "<text transform=\"translate(" << 24 << "," << y0 + kTop + plot_h / 2
      << ") rotate(-90)\" text-anchor=\"middle\" font-size=\"12\">" << xml(y_label)
      << "</text>\n"
      << "<text x=\"" << kLeft + plot_w / 2 << "\" y=\"" << y0 + kPanelHeight - 12
      << "\" text-anchor=\"middle\" font-size=\"12\">granularity</text>\n";

  const double slot = plot_w / std::max<size_t>(bars.size(), 1);
  const double bar_w = std::min(80.0, slot * 0.6);
  const size_t label_chars = static_cast<size_t>(std::max(6.0, slot / 7));
  for (size_t i = 0; i < bars.size(); ++i) {
    const Bar& b = bars[i];
    const double cx = kLeft + slot * (static_cast<double>(i) + 0.5);
    const double y = y_of(b.value);
    svg << "<g><title>" << xml(b.label) << ": " << num(b.value, digits_for(b.value))
        << "</title>\n"
        << "<rect x=\"" << cx - bar_w / 2 << "\" y=\"" << y << "\" width=\"" << bar_w
        << "\" height=\"" << base - y << "\" fill=\"" << color << "\"/>\n";
    double label_y = y - 6;
    if (b.hi > b.lo) {
      const double ylo = y_of(b.lo), yhi = y_of(b.hi);
      svg << "<line x1=\"" << cx << "\" y1=\"" << ylo << "\" x2=\"" << cx << "\" y2=\"" << yhi
          << "\" stroke=\"#222\"/>\n"
          << "<line x1=\"" << cx - 6 << "\" y1=\"" << yhi << "\" x2=\"" << cx + 6 << "\" y2=\""
          << yhi << "\" stroke=\"#222\"/>\n"
          << "<line x1=\"" << cx - 6 << "\" y1=\"" << ylo << "\" x2=\"" << cx + 6 << "\" y2=\""
          << ylo << "\" stroke=\"#222\"/>\n";
      label_y = std::min(label_y, yhi - 6);
    }
    svg << "<text x=\"" << cx << "\" y=\"" << label_y
        << "\" text-anchor=\"middle\" font-size=\"11\">" << num(b.value, digits_for(b.value))
        << "</text>\n"
        << "<text x=\"" << cx << "\" y=\"" << base + 18
        << "\" text-anchor=\"middle\" font-size=\"12\">" << xml(shorten(b.label, label_chars))
        << "</text></g>\n";
  }
}

}  // namespace

std::string render_svg(const Report& rep) {
  std::vector<Bar> time, memory;
  for (const auto& r : rep.rows) {
    time.push_back({r.run.granularity, r.median_ms, r.min_ms, r.max_ms});
    const double mib = static_cast<double>(r.run.peak_memory_bytes) / (1 << 20);
    memory.push_back({r.run.granularity, mib, mib, mib});
  }
  const auto& m = rep.options.model;
  std::ostringstream svg;
  svg << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << kWidth << "\" height=\""
      << 2 * kPanelHeight + 40 << "\" viewBox=\"0 0 " << kWidth << " " << 2 * kPanelHeight + 40
      << "\" font-family=\"sans-serif\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"" << kWidth / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"13\">"
      << xml("flatshard-bench: " + std::string(m.family().display_name()) + " " +
             rep.options.preset + " (L" + std::to_string(m.n_layers()) + " d" +
             std::to_string(m.d_model()) + " T" + std::to_string(m.seq_len()) + "), " +
             rep.device_description)
      << "</text>\n";
  panel(svg, 20, "Median step time (whiskers: min-max)", "step time (ms)", "#4878b0", time);
  panel(svg, 20 + kPanelHeight, "Peak memory per rank", "peak memory (MiB)", "#e08a3c", memory);
  svg << "</svg>\n";
  return svg.str();
}

void write_svg(const Report& rep, const std::string& path) {
  write_file(path, render_svg(rep), "--plot");
}

}  // namespace bench
}  // namespace flatshard

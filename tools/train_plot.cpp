// flatshard/tools/train_plot.cpp — see train_plot.h.
#include "tools/train_plot.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "support/format.h"
#include "support/output_file.h"

namespace flatshard {
namespace train {

std::string render_loss_svg(const std::vector<std::pair<int64_t, double>>& curve) {
  constexpr double kW = 640, kH = 360, kLeft = 70, kRight = 20, kTop = 40, kBottom = 50;
  std::vector<std::pair<int64_t, double>> pts;
  for (const auto& p : curve)
    if (std::isfinite(p.second)) pts.push_back(p);
  std::ostringstream os;
  os << "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"" << kW << "\" height=\""
     << kH << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
     << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
     << "<text x=\"" << kW / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">"
     << "Training loss</text>\n";
  const double x0 = kLeft, x1 = kW - kRight, y0 = kH - kBottom, y1 = kTop;
  os << "<line x1=\"" << x0 << "\" y1=\"" << y0 << "\" x2=\"" << x1 << "\" y2=\"" << y0
     << "\" stroke=\"black\"/>\n<line x1=\"" << x0 << "\" y1=\"" << y0 << "\" x2=\"" << x0
     << "\" y2=\"" << y1 << "\" stroke=\"black\"/>\n"
     << "<text x=\"" << (x0 + x1) / 2 << "\" y=\"" << kH - 12
     << "\" text-anchor=\"middle\">step</text>\n";
  if (!pts.empty()) {
    int64_t smin = pts.front().first, smax = pts.front().first;
    double lmin = pts.front().second, lmax = pts.front().second;
    for (const auto& [s, l] : pts) {
      smin = std::min(smin, s);
      smax = std::max(smax, s);
      lmin = std::min(lmin, l);
      lmax = std::max(lmax, l);
    }
    const double sx = smax > smin ? (x1 - x0) / static_cast<double>(smax - smin) : 0;
    const double sy = lmax > lmin ? (y0 - y1) / (lmax - lmin) : 0;
    os << "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.5\" points=\"";
    for (const auto& [s, l] : pts)
      os << format_fixed(x0 + static_cast<double>(s - smin) * sx, 1) << ","
         << format_fixed(sy > 0 ? y0 - (l - lmin) * sy : (y0 + y1) / 2, 1) << " ";
    os << "\"/>\n";
    os << "<text x=\"" << x0 << "\" y=\"" << y0 + 16 << "\" text-anchor=\"middle\">" << smin
       << "</text>\n<text x=\"" << x1 << "\" y=\"" << y0 + 16 << "\" text-anchor=\"middle\">"
       << smax << "</text>\n<text x=\"" << x0 - 6 << "\" y=\"" << y0 << "\" text-anchor=\"end\">"
       << format_fixed(lmin, 3) << "</text>\n<text x=\"" << x0 - 6 << "\" y=\"" << y1 + 4
       << "\" text-anchor=\"end\">" << format_fixed(lmax, 3) << "</text>\n";
  }
  os << "</svg>\n";
  return os.str();
}

void write_loss_svg(const std::vector<std::pair<int64_t, double>>& curve, const std::string& path) {
  write_file(path, render_loss_svg(curve), "loss curve");
}

}  // namespace train
}  // namespace flatshard

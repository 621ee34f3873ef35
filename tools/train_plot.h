// flatshard/tools/train_plot.h — flatshard-train's loss curve as an SVG line chart.
//
// One polyline of (step, loss) in the order given, axes with the first and last step and the
// lowest and highest loss, a title. Hand-written SVG 1.1 like the bench's chart
// (benchmarks/bench_plot.h), no scripts or external resources; written whole or not at all
// (support/output_file.h). Non-finite losses are left out of the curve.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace flatshard {
namespace train {

std::string render_loss_svg(const std::vector<std::pair<int64_t, double>>& curve);
void write_loss_svg(const std::vector<std::pair<int64_t, double>>& curve, const std::string& path);

}  // namespace train
}  // namespace flatshard

// flatshard/benchmarks/bench_plot.h — the SVG chart of a benchmark report.
//
// Two bar charts, one above the other, one bar per granularity in report order: median step
// time (ms, whiskers from min to max) and peak memory per rank (MiB). Each has a title, a
// labelled y axis with round tick values, the value printed above every bar, and the
// granularity under it (long policy specs are shortened with an ellipsis; the full label is the
// bar's tooltip). Hand-written SVG 1.1, no scripts or external resources; text is XML-escaped.
// write_svg writes like write_json (bench_report.h): whole or not at all; throws c10::Error.
#pragma once

#include <string>

#include "benchmarks/bench_report.h"

namespace flatshard {
namespace bench {

std::string render_svg(const Report& report);
void write_svg(const Report& report, const std::string& path);

}  // namespace bench
}  // namespace flatshard

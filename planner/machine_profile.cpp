// flatshard/planner/machine_profile.cpp — see machine_profile.h.
#include "planner/machine_profile.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <vector>

#include "support/input_file.h"
#include "support/json.h"
#include "support/output_file.h"

namespace flatshard {

namespace {

constexpr const char* kFormat = "flatshard-machine-profile";
constexpr int64_t kVersion = 1;

// A numeric key: where it lives and its physical bounds (machine_profile.h states them next to
// each key).
struct Field {
  const char* key;
  double MachineProfile::*member;
  double lo, hi;
  const char* unit;  // for messages
};

constexpr double kLatency = kMaxLatencyUs;
constexpr double kMinGbps = 1e-4, kMaxGbps = 1e5;
constexpr double kMaxHostMs = 1e6;

const std::vector<Field>& fields() {
  using P = MachineProfile;
  static const std::vector<Field> f = {
      {"all_gather_latency_us", &P::all_gather_latency_us, 0, kLatency, "us"},
      {"all_gather_gbps", &P::all_gather_gbps, kMinGbps, kMaxGbps, "GB/s"},
      {"reduce_scatter_latency_us", &P::reduce_scatter_latency_us, 0, kLatency, "us"},
      {"reduce_scatter_gbps", &P::reduce_scatter_gbps, kMinGbps, kMaxGbps, "GB/s"},
      {"all_reduce_latency_us", &P::all_reduce_latency_us, 0, kLatency, "us"},
      {"all_reduce_gbps", &P::all_reduce_gbps, kMinGbps, kMaxGbps, "GB/s"},
      {"host_ms_per_step", &P::host_ms_per_step, 0, kMaxHostMs, "ms"},
      {"host_reference_layers", &P::host_reference_layers, 1, 1e6, "layers"},
      {"host_us_per_unit_forward", &P::host_us_per_unit_forward, 0, kLatency, "us"},
      {"host_us_per_unit_backward", &P::host_us_per_unit_backward, 0, kLatency, "us"},
      {"host_overlap_norm", &P::host_overlap_norm, 1, 64, ""},
      {"compute_tflops", &P::compute_tflops, 1e-6, 1e5, "TFLOP/s"},
      {"memory_gbps", &P::memory_gbps, kMinGbps, kMaxGbps, "GB/s"},
      {"optimizer_bytes_per_param", &P::optimizer_bytes_per_param, 0, 1024, "bytes"},
      {"h2d_gbps", &P::h2d_gbps, kMinGbps, kMaxGbps, "GB/s"},
      {"d2h_gbps", &P::d2h_gbps, kMinGbps, kMaxGbps, "GB/s"},
      {"cpu_optimizer_params_per_s", &P::cpu_optimizer_params_per_s, 1e3, 1e13, "parameters/s"},
      {"copy_rate_beside_compute", &P::copy_rate_beside_compute, 1e-3, 1, ""},
      {"activation_scale", &P::activation_scale, 1e-2, 1e2, ""},
      {"allocator_slack", &P::allocator_slack, 0, 10, ""},
      {"collective_staging", &P::collective_staging, 0, 16, "copies"},
      {"comm_overlap", &P::comm_overlap, 0, 1, "(0 or 1)"},
      {"gpus_per_node", &P::gpus_per_node, 0, 1e6, "GPUs (a whole number; 0: no topology)"},
      {"intra_node_hop_latency_us", &P::intra_node_hop_latency_us, 0, kLatency, "us"},
      {"inter_node_hop_latency_us", &P::inter_node_hop_latency_us, 0, kLatency, "us"},
      {"inter_node_gbps", &P::inter_node_gbps, kMinGbps, kMaxGbps, "GB/s"},
      {"peak_tflops", &P::peak_tflops, 0, 1e5, "TFLOP/s (0: unknown)"},
      {"device_memory_gb", &P::device_memory_gb, 0, 1e6, "GB (0: unknown)"},
  };
  return f;
}

// "" when `v` is a valid value of `f`, else why not (naming the key, its bounds and the value).
std::string out_of_bounds(const Field& f, double v) {
  const bool binary = f.member == &MachineProfile::comm_overlap;
  const bool whole = f.member == &MachineProfile::gpus_per_node;
  if (std::isfinite(v) && v >= f.lo && v <= f.hi && (!binary || v == 0 || v == 1) &&
      (!whole || v == std::floor(v)))
    return "";
  std::ostringstream why;
  if (whole && std::isfinite(v) && v >= f.lo && v <= f.hi) {
    why << "'" << f.key << "' must be a whole number of GPUs, got " << v;
  } else if (binary) {
    why << "'" << f.key << "' must be 0 or 1, got " << v;
  } else if (f.member == &MachineProfile::copy_rate_beside_compute && v > f.hi) {
    why << "'" << f.key << "' must be in (0, 1], got " << v;  // a share of the copy rate
  } else {
    why << "'" << f.key << "' must be " << (f.lo > 0 ? "> 0" : ">= 0") << " and at most " << f.hi
        << ", within its physical bounds [" << f.lo << ", " << f.hi << "]" << (*f.unit ? " " : "")
        << f.unit << " (planner/machine_profile.h), got " << v;
  }
  return why.str();
}

constexpr int64_t kMaxFileBytes = int64_t{1} << 20;

}  // namespace

std::string MachineProfile::to_json() const {
  std::ostringstream os;
  os << "{\n  \"format\": " << json::quote(kFormat) << ",\n  \"version\": " << kVersion
     << ",\n  \"source\": " << json::quote(source);
  for (const Field& f : fields())
    os << ",\n  " << json::quote(f.key) << ": " << json::number(this->*f.member);
  if (!sources.empty()) {
    os << ",\n  \"sources\": {";
    const char* sep = "\n    ";
    for (const Field& f : fields()) {  // in the keys' order
      const auto it = sources.find(f.key);
      if (it == sources.end()) continue;
      os << sep << json::quote(f.key) << ": " << json::quote(it->second);
      sep = ",\n    ";
    }
    os << "\n  }";
  }
  os << "\n}\n";
  return os.str();
}

std::string MachineProfile::to_string() const {
  std::ostringstream os;
  os << "machine profile (" << printable_escape(source) << "):";
  for (const Field& f : fields()) os << " " << f.key << "=" << this->*f.member;
  return os.str();
}

namespace {

MachineProfile profile_of(const json::Json& doc, const std::string& origin) {
  const json::Node root(doc, origin);
  if (!root.is_object()) root.fail("a machine profile must be a JSON object");
  MachineProfile p;
  bool format_seen = false, version_seen = false;
  for (const auto& [key, node] : root.members()) {
    if (key == "format") {
      if (node.as_string() != kFormat)
        node.fail("expected \"" + std::string(kFormat) + "\", got \"" + node.as_string() + "\"");
      format_seen = true;
      continue;
    }
    if (key == "version") {
      if (node.as_int() != kVersion)
        node.fail("unsupported version " + std::to_string(node.as_int()) + " (this build reads " +
                  std::to_string(kVersion) + ")");
      version_seen = true;
      continue;
    }
    if (key == "source") {
      p.source = printable_escape(node.as_string());  // printed to terminals (machine_profile.h)
      continue;
    }
    if (key == "sources") {
      if (!node.is_object()) node.fail("expected an object from numeric keys to their sources");
      for (const auto& [of, text] : node.members()) {
        bool known = false;
        for (const Field& f : fields()) known = known || of == f.key;
        if (!known)
          text.fail("'" + printable_escape(of) + "' is not a numeric key of the profile");
        const std::string& t = text.as_string();
        if (t.rfind("spec:", 0) != 0 && t.rfind("measured:", 0) != 0 &&
            t.rfind("estimate:", 0) != 0)
          text.fail("a source must start with \"spec:\", \"measured:\" or \"estimate:\", got \"" +
                    printable_escape(t.substr(0, 40)) + "\"");
        p.sources[of] = printable_escape(t);  // printed to terminals
      }
      continue;
    }
    const Field* field = nullptr;
    for (const Field& f : fields())
      if (key == f.key) field = &f;
    if (!field && key == "offload_overlap")  // the key this one replaced
      node.fail("'offload_overlap' is retired: rerun flatshard-bench --write-profile, which "
                "writes 'copy_rate_beside_compute' (planner/machine_profile.h)");
    if (!field) {
      std::string known = "format, version, source, sources";
      for (const Field& f : fields()) known += std::string(", ") + f.key;
      node.fail("unknown key '" + key + "' (known: " + known + ")");
    }
    const double v = node.as_number();  // JSON cannot hold NaN/Inf; huge literals can overflow
    const std::string why = out_of_bounds(*field, v);
    if (!why.empty()) node.fail(why);
    p.*(field->member) = v;
  }
  if (!format_seen) root.fail("missing \"format\": \"" + std::string(kFormat) + "\"");
  if (!version_seen) root.fail("missing \"version\"");
  return p;
}

}  // namespace

MachineProfile parse_profile(const std::string& text, const std::string& origin) {
  return profile_of(json::parse(text, origin), origin);
}

MachineProfile load_profile(const std::string& path) {
  // Untrusted input: a regular file of sane size, never blocking (support/input_file.h).
  const std::string origin = "machine profile '" + printable_escape(path) + "'";
  return profile_of(
      read_json_file(path, kMaxFileBytes, "machine profile", "a profile's limit"),
      origin);
}

namespace detail {
// name -> JSON text of planner/profiles/*.json (named_profiles.cpp, generated by CMake).
const std::vector<std::pair<std::string, std::string>>& named_profile_texts();
}  // namespace detail

std::vector<std::string> named_profiles() {
  std::vector<std::string> names;
  for (const auto& [name, text] : detail::named_profile_texts()) names.push_back(name);
  std::sort(names.begin(), names.end());
  return names;
}

MachineProfile load_profile_named(const std::string& name_or_path) {
  for (const auto& [name, text] : detail::named_profile_texts())
    if (name == name_or_path)
      return parse_profile(text, "machine profile '" + name + "' (planner/profiles/" + name +
                                     ".json)");
  if (name_or_path.find('/') == std::string::npos &&
      name_or_path.find('.') == std::string::npos) {
    // Not a name and no path-like text: say both readings.
    std::string names;
    for (const auto& n : named_profiles()) names += (names.empty() ? "" : ", ") + n;
    try {
      return load_profile(name_or_path);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "machine profile '", printable_escape(name_or_path),
                  "' is neither a named profile (", names, ") nor a readable file: ",
                  e.what_without_backtrace());
    }
  }
  return load_profile(name_or_path);
}

void check_profile(const MachineProfile& profile, const std::string& origin) {
  for (const Field& f : fields()) {
    const std::string why = out_of_bounds(f, profile.*f.member);
    TORCH_CHECK(why.empty(), origin, ": ", why);
  }
}

void save_profile(const MachineProfile& profile, const std::string& path) {
  check_profile(profile, "machine profile '" + printable_escape(path) + "' (not written)");
  write_file(path, profile.to_json(), "machine profile");
}

}  // namespace flatshard

// flatshard/planner/machine_profile.cpp — see machine_profile.h.
#include "planner/machine_profile.h"

#include <c10/util/Exception.h>

#include <sys/stat.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <sstream>
#include <vector>

#include "support/json.h"
#include "support/output_file.h"

namespace flatshard {

namespace {

constexpr const char* kFormat = "flatshard-machine-profile";
constexpr int64_t kVersion = 1;

// A numeric key: where it lives, and whether 0 is allowed (a latency or a slack may be 0; a
// rate or a divisor may not).
struct Field {
  const char* key;
  double MachineProfile::*member;
  bool zero_ok;
};

const std::vector<Field>& fields() {
  static const std::vector<Field> f = {
      {"all_gather_latency_us", &MachineProfile::all_gather_latency_us, true},
      {"all_gather_gbps", &MachineProfile::all_gather_gbps, false},
      {"reduce_scatter_latency_us", &MachineProfile::reduce_scatter_latency_us, true},
      {"reduce_scatter_gbps", &MachineProfile::reduce_scatter_gbps, false},
      {"all_reduce_latency_us", &MachineProfile::all_reduce_latency_us, true},
      {"all_reduce_gbps", &MachineProfile::all_reduce_gbps, false},
      {"host_ms_per_step", &MachineProfile::host_ms_per_step, true},
      {"host_reference_layers", &MachineProfile::host_reference_layers, false},
      {"host_us_per_unit_forward", &MachineProfile::host_us_per_unit_forward, true},
      {"host_us_per_unit_backward", &MachineProfile::host_us_per_unit_backward, true},
      {"host_overlap_norm", &MachineProfile::host_overlap_norm, false},
      {"compute_tflops", &MachineProfile::compute_tflops, false},
      {"memory_gbps", &MachineProfile::memory_gbps, false},
      {"optimizer_bytes_per_param", &MachineProfile::optimizer_bytes_per_param, true},
      {"h2d_gbps", &MachineProfile::h2d_gbps, false},
      {"d2h_gbps", &MachineProfile::d2h_gbps, false},
      {"cpu_optimizer_params_per_s", &MachineProfile::cpu_optimizer_params_per_s, false},
      {"copy_rate_beside_compute", &MachineProfile::copy_rate_beside_compute, false},
      {"activation_scale", &MachineProfile::activation_scale, false},
      {"allocator_slack", &MachineProfile::allocator_slack, true},
      {"collective_staging", &MachineProfile::collective_staging, true},
      {"comm_overlap", &MachineProfile::comm_overlap, true},
  };
  return f;
}

// Sanity bound: no rate, time or factor of a real machine comes near it; keeps every product
// with byte counts finite.
constexpr double kMaxValue = 1e15;
constexpr int64_t kMaxFileBytes = int64_t{1} << 20;

}  // namespace

std::string MachineProfile::to_json() const {
  std::ostringstream os;
  os << "{\n  \"format\": " << json::quote(kFormat) << ",\n  \"version\": " << kVersion
     << ",\n  \"source\": " << json::quote(source);
  for (const Field& f : fields())
    os << ",\n  " << json::quote(f.key) << ": " << json::number(this->*f.member);
  os << "\n}\n";
  return os.str();
}

std::string MachineProfile::to_string() const {
  std::ostringstream os;
  os << "machine profile (" << source << "):";
  for (const Field& f : fields()) os << " " << f.key << "=" << this->*f.member;
  return os.str();
}

MachineProfile parse_profile(const std::string& text, const std::string& origin) {
  const json::Json doc = json::parse(text, origin);
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
      p.source = node.as_string();
      continue;
    }
    const Field* field = nullptr;
    for (const Field& f : fields())
      if (key == f.key) field = &f;
    if (!field && key == "offload_overlap")  // the key this one replaced
      node.fail("'offload_overlap' is retired: rerun flatshard-bench --write-profile, which "
                "writes 'copy_rate_beside_compute' (planner/machine_profile.h)");
    if (!field) {
      std::string known = "format, version, source";
      for (const Field& f : fields()) known += std::string(", ") + f.key;
      node.fail("unknown key '" + key + "' (known: " + known + ")");
    }
    const double v = node.as_number();  // JSON cannot hold NaN/Inf; huge literals can overflow
    if (!std::isfinite(v) || v < 0 || (v == 0 && !field->zero_ok) || v > kMaxValue) {
      std::ostringstream why;
      why << "'" << key << "' must be " << (field->zero_ok ? ">= 0" : "> 0") << " and at most "
          << kMaxValue << ", got " << v;
      node.fail(why.str());
    }
    if (field->member == &MachineProfile::comm_overlap && v != 0 && v != 1)
      node.fail("'comm_overlap' must be 0 or 1, got " + std::to_string(v));
    if (field->member == &MachineProfile::copy_rate_beside_compute && v > 1)
      node.fail("'copy_rate_beside_compute' must be in (0, 1], got " + std::to_string(v));
    p.*(field->member) = v;
  }
  if (!format_seen) root.fail("missing \"format\": \"" + std::string(kFormat) + "\"");
  if (!version_seen) root.fail("missing \"version\"");
  return p;
}

MachineProfile load_profile(const std::string& path) {
  // Untrusted input: a regular file of sane size, checked before reading (a FIFO or a device
  // would block or never end; a directory is not a profile).
  struct stat st {};
  TORCH_CHECK(::stat(path.c_str(), &st) == 0, "machine profile '", path,
              "': cannot stat: ", std::strerror(errno));
  TORCH_CHECK(S_ISREG(st.st_mode), "machine profile '", path, "': not a regular file");
  TORCH_CHECK(st.st_size <= kMaxFileBytes, "machine profile '", path, "': ", st.st_size,
              " bytes, more than a profile's ", kMaxFileBytes, " (a flat object of numbers)");
  const json::Json doc = json::parse_file(path);  // errors name the path
  return parse_profile(doc.dump(), "machine profile '" + path + "'");
}

void save_profile(const MachineProfile& profile, const std::string& path) {
  write_file(path, profile.to_json(), "machine profile");
}

}  // namespace flatshard

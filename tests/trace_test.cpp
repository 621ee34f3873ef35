// Per-unit traces (fsdp/trace.h) and their summary (tools/trace_summary.h), label diagnostics.
//
// CPU, ranks as threads: the trace files must be valid JSON (read with checkpoint/json.h, written
// independently of fsdp/trace.cpp), hold exactly the expected events per unit and step, nest
// properly on the host track (Perfetto draws misnested slices wrongly), and agree with the
// runtime's counters. The summary must find a planted delay — a Communicator decorator that
// slows every all-gather of one unit — and name that unit first. The GPU analysis (waits and
// host-starved gaps) is checked on a hand-made GPU trace.
#include <catch2/catch.hpp>

#include <torch/nn/modules/linear.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>

#include <unistd.h>

#include "checkpoint/json.h"
#include "collectives/thread_communicator.h"
#include "fsdp/call.h"
#include "fsdp/sharded_model.h"
#include "fsdp/trace.h"
#include "models/gpt.h"
#include "tools/trace_summary.h"
#include "wrap_policies/policy.h"
#include "wrap_policies/spec.h"

using namespace flatshard;
namespace g = flatshard::gpt;
namespace fs = std::filesystem;

namespace {

fs::path temp_dir(const std::string& name) {
  fs::path p = fs::temp_directory_path() /
               ("flatshard_diag_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

// Trains the tiny GPT for `steps` steps on `world` ranks with tracing to `path`.
void train_tiny_traced(int world, const std::string& spec, const std::string& path, int steps,
                       int max_steps = 64, std::vector<StepCounters>* counters = nullptr) {
  std::mutex mu;
  run_ranks(world, [&](Communicator& comm) {
    auto model = g::GPT(g::GPTConfig::preset("tiny"), 0);
    ShardingOptions o;
    o.trace.path = path;
    o.trace.max_steps = max_steps;
    auto fsdp = fully_shard(model.ptr(), make_plan(*model, parse_policy(spec)), comm, o);
    REQUIRE(fsdp->tracer() != nullptr);
    for (int step = 0; step < steps; ++step) {
      fsdp->reset_counters();
      auto [x, y] = g::synthetic_batch(model->config(), 2, 3, comm.rank(), step);
      auto loss = flatshard::enter(model, [&, &x = x, &y = y] { return model->loss(x, y); });
      loss.backward();
      auto t = fsdp->trace_optimizer_step();  // no optimizer needed to test the scope
    }
    if (counters && comm.rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      counters->push_back(fsdp->counters());
    }
  });  // the ShardedModels are destroyed here: each rank writes its file
}

// Events of one rank's file, as (unit, cat) -> count, per step.
using Counts = std::map<std::pair<std::string, std::string>, int>;
std::map<int, Counts> count_events(const json::Value& doc) {
  std::map<int, Counts> out;
  for (const auto& e : doc.at("traceEvents").as_array()) {
    if (e.at("ph").as_string() != "X") continue;
    const auto& args = e.at("args");
    const int step = static_cast<int>(args.at("step").as_number());
    const std::string cat = e.at("cat").as_string();
    std::string key = cat;
    if (cat == "all_gather") key += "/" + args.at("phase").as_string();
    out[step][{args.string_or("unit", ""), key}] += 1;
  }
  return out;
}

// Host-track events must nest: each starts after the enclosing one and ends before it does.
void require_nested(const json::Value& doc) {
  std::vector<std::pair<double, double>> spans;
  for (const auto& e : doc.at("traceEvents").as_array())
    if (e.at("ph").as_string() == "X" && e.at("tid").as_number() == 0)
      spans.emplace_back(e.at("ts").as_number(), e.at("ts").as_number() + e.at("dur").as_number());
  std::sort(spans.begin(), spans.end(), [](const auto& a, const auto& b) {
    return a.first < b.first || (a.first == b.first && a.second > b.second);
  });
  std::vector<double> ends;
  for (const auto& [b, e] : spans) {
    while (!ends.empty() && ends.back() <= b) ends.pop_back();
    CAPTURE(b, e);
    if (!ends.empty()) REQUIRE(e <= ends.back() + 1e-3);  // printed with 3 decimals
    ends.push_back(e);
  }
}

// A Communicator that forwards to another and sleeps before every all-gather whose output has
// `numel` elements: a slow link or straggler, planted on one unit.
class DelayingCommunicator final : public Communicator {
 public:
  DelayingCommunicator(Communicator& inner, int64_t numel, std::chrono::milliseconds delay)
      : inner_(inner), numel_(numel), delay_(delay) {}
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  std::string backend_name() const override { return "delaying(" + inner_.backend_name() + ")"; }
  c10::Device device() const override { return inner_.device(); }
  void all_gather(const at::Tensor& in, const at::Tensor& out, c10::Stream s) override {
    if (out.numel() == numel_) std::this_thread::sleep_for(delay_);
    inner_.all_gather(in, out, s);
  }
  void reduce_scatter(const at::Tensor& in, const at::Tensor& out, ReduceOp op,
                      c10::Stream s) override {
    inner_.reduce_scatter(in, out, op, s);
  }
  void all_reduce(const at::Tensor& t, ReduceOp op, c10::Stream s, Lane lane) override {
    inner_.all_reduce(t, op, s, lane);
  }
  void broadcast(const at::Tensor& t, int root, c10::Stream s) override {
    inner_.broadcast(t, root, s);
  }
  void barrier() override { inner_.barrier(); }
  std::chrono::milliseconds timeout() const override { return inner_.timeout(); }

 private:
  Communicator& inner_;
  int64_t numel_;
  std::chrono::milliseconds delay_;
};

// Four Linear layers of distinct sizes, so each unit's flat buffer has its own size.
struct ChainImpl : torch::nn::Module {
  ChainImpl() {
    for (int i = 0; i < 4; ++i)
      layers.push_back(register_module("l" + std::to_string(i), torch::nn::Linear(8 + i, 9 + i)));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& l : layers) x = at::tanh(flatshard::call(l, x));
    return x.pow(2).mean();
  }
  std::vector<torch::nn::Linear> layers;
};
TORCH_MODULE(Chain);

}  // namespace

TEST_CASE("trace: CPU files are valid JSON with the expected events per unit",
          "[diagnostics][trace]") {
  const auto dir = temp_dir("events");
  const std::string path = (dir / "t.json").string();
  std::vector<StepCounters> counters;
  train_tiny_traced(2, "type=Block", path, 3, 64, &counters);
  for (int rank = 0; rank < 2; ++rank) {
    const std::string file = trace_file_for_rank(path, rank, 2);
    CAPTURE(file);
    REQUIRE(fs::exists(file));
    const json::Value doc = json::parse_file(file);  // throws on invalid JSON
    const auto& other = doc.at("otherData");
    CHECK(other.at("rank").as_number() == rank);
    CHECK(other.at("world_size").as_number() == 2);
    CHECK(other.at("units").as_array().size() == 3);
    require_nested(doc);

    const auto counts = count_events(doc);
    REQUIRE(counts.size() == 3);  // steps 0, 1, 2
    for (const auto& [step, c] : counts) {
      CAPTURE(step);
      Counts want = {
          {{"", "step"}, 1},
          {{"", "optimizer"}, 1},
          {{"<root>", "pre_forward"}, 1},
          {{"<root>", "forward"}, 1},
          {{"<root>", "all_gather/forward"}, 1},  // kept from forward to backward
          {{"<root>", "pre_backward"}, 1},
          {{"<root>", "backward"}, 1},
          {{"<root>", "reduce"}, 1},
          {{"<root>", "reshard"}, 1},
      };
      for (const char* b : {"blocks.0", "blocks.1"}) {
        for (const char* cat : {"pre_forward", "forward", "all_gather/forward",
                                "all_gather/backward", "pre_backward", "backward", "reduce"})
          want[{b, cat}] = 1;
        want[{b, "reshard"}] = 2;  // after forward and after backward
      }
      CHECK(c == want);
    }
    // Bytes on the all-gather events are the unit's, and agree with the runtime's counters.
    int64_t ag_bytes = 0;
    for (const auto& e : doc.at("traceEvents").as_array())
      if (e.at("ph").as_string() == "X" && e.at("cat").as_string() == "all_gather" &&
          e.at("args").at("step").as_number() == 2)
        ag_bytes += static_cast<int64_t>(e.at("args").at("bytes").as_number());
    const auto& units = other.at("units").as_array();
    int64_t counted = 0;  // the runtime's all-gathers of step 2 times each unit's bytes
    for (size_t i = 0; i < units.size(); ++i) {
      const auto& c = counters.at(0).per_unit.at(i);
      counted += (c.forward_all_gathers + c.backward_all_gathers) *
                 static_cast<int64_t>(units[i].at("all_gather_bytes").as_number());
    }
    CHECK(ag_bytes == counted);
  }
}

TEST_CASE("trace: a unit entered twice per forward has one backward span",
          "[diagnostics][trace]") {
  const auto dir = temp_dir("grouped");
  const std::string path = (dir / "t.json").string();
  train_tiny_traced(2, "every=2,type=Block", path, 2);
  const json::Value doc = json::parse_file(trace_file_for_rank(path, 0, 2));
  require_nested(doc);
  const auto counts = count_events(doc);
  REQUIRE(counts.size() == 2);
  const Counts& c = counts.at(1);
  const std::string u = "blocks.0-1";
  CHECK(c.at({u, "pre_forward"}) == 2);  // one per member call
  CHECK(c.at({u, "forward"}) == 2);
  CHECK(c.at({u, "all_gather/forward"}) == 1);
  CHECK(c.at({u, "all_gather/backward"}) == 1);
  CHECK(c.at({u, "pre_backward"}) == 2);  // each member call's outputs are hooked
  CHECK(c.at({u, "backward"}) == 1);
  CHECK(c.at({u, "reduce"}) == 1);
  CHECK(c.at({u, "reshard"}) == 2);
}

TEST_CASE("trace: max_steps bounds the recording; FLATSHARD_TRACE switches it on",
          "[diagnostics][trace]") {
  const auto dir = temp_dir("steps");
  const std::string path = (dir / "t_{rank}.json").string();
  train_tiny_traced(2, "type=Block", path, 3, /*max_steps=*/1);
  const auto doc = json::parse_file((dir / "t_1.json").string());
  CHECK(count_events(doc).size() == 1);

  const std::string env_path = (dir / "env.json").string();
  ::setenv("FLATSHARD_TRACE", env_path.c_str(), 1);
  run_ranks(1, [&](Communicator& comm) {
    auto model = g::GPT(g::GPTConfig::preset("tiny"), 0);
    auto fsdp = fully_shard(model.ptr(), make_plan(*model, parse_policy("type=Block")), comm);
    CHECK(fsdp->tracer() != nullptr);
    auto [x, y] = g::synthetic_batch(model->config(), 2, 3, comm.rank(), 0);
    flatshard::enter(model, [&, &x = x, &y = y] { return model->loss(x, y); }).backward();
    CHECK(fsdp->write_trace() == env_path);  // world 1: the path as given
  });
  ::unsetenv("FLATSHARD_TRACE");
  CHECK(fs::exists(env_path));
  run_ranks(1, [&](Communicator& comm) {
    auto model = g::GPT(g::GPTConfig::preset("tiny"), 0);
    auto fsdp = fully_shard(model.ptr(), make_plan(*model, parse_policy("type=Block")), comm);
    CHECK(fsdp->tracer() == nullptr);  // off: no tracer at all
    CHECK(fsdp->write_trace().empty());
  });
  CHECK(trace_file_for_rank("a/run.json", 3, 8) == "a/run.rank3.json");
  CHECK(trace_file_for_rank("a/run", 3, 8) == "a/run.rank3");
  CHECK(trace_file_for_rank("a/{rank}/r.json", 3, 8) == "a/3/r.json");
  CHECK(trace_file_for_rank("run.json", 0, 1) == "run.json");
}

TEST_CASE("trace summary: a planted all-gather delay names its unit first",
          "[diagnostics][trace]") {
  const auto dir = temp_dir("delay");
  const std::string path = (dir / "t.json").string();
  // l2: weight 10x11 = 110 at 0, bias 11 at 112 -> 123 -> padded 128 at world 2 (the others
  // are 96, 112, 160), so the decorator recognises l2's all-gathers by their size.
  const int64_t target = 128;
  const auto delay = std::chrono::milliseconds(40);
  run_ranks(2, [&](Communicator& inner) {
    DelayingCommunicator comm(inner, target, delay);
    torch::manual_seed(0);
    auto model = Chain();
    ShardingOptions o;
    o.trace.path = path;
    auto fsdp = fully_shard(model.ptr(), make_plan(*model, parse_policy("type=Linear")), comm, o);
    REQUIRE(fsdp->units()[3].name == "l2");
    REQUIRE(fsdp->units()[3].padded_numel == target);
    for (int step = 0; step < 3; ++step) {
      at::Tensor x = at::randn({4, 8});
      flatshard::enter(model, [&] { return model->forward(x); }).backward();
    }
  });
  const auto ranks = read_trace_files({trace_file_for_rank(path, 0, 2), trace_file_for_rank(path, 1, 2)});
  REQUIRE(ranks.size() == 2);
  const TraceSummary s = summarize(ranks);
  INFO(s.to_string());
  CHECK_FALSE(s.gpu);
  CHECK(s.steps_used == std::vector<int>{1, 2});
  REQUIRE_FALSE(s.offenders.empty());
  const UnitCost& top = s.units[s.offenders.front()];
  CHECK(top.unit == "l2");
  // Two delayed all-gathers per step (forward and backward), 40 ms each.
  CHECK(top.all_gather_forward_us >= 0.9 * 40000);
  CHECK(top.all_gather_backward_us >= 0.9 * 40000);
  CHECK(top.all_gathers == Approx(2.0));
  CHECK(top.advice.find("delayed rank") != std::string::npos);
  CHECK(s.to_string().find("1. l2") != std::string::npos);

  // A merged file reads back as the same two ranks.
  const json::Value merged = merge_traces({json::parse_file(trace_file_for_rank(path, 0, 2)),
                                           json::parse_file(trace_file_for_rank(path, 1, 2))});
  const auto again = read_traces(json::parse(json::write(merged)));
  REQUIRE(again.size() == 2);
  CHECK(summarize(again).units[s.offenders.front()].unit == "l2");
}

TEST_CASE("trace summary: GPU waits and host-starved gaps", "[diagnostics][trace]") {
  // A hand-made GPU trace of one rank, step 1 (step 0 is warm-up and ignored). Compute stream
  // (tid 1): u0 forward 0-1000; u1 waits 1000-3000 for its all-gather, then runs 3000-4000;
  // u2 starts at 6000, recorded by the host at 5990 (the GPU was idle 4000-6000: host-bound).
  auto ev = [](const char* name, const char* cat, int tid, double ts, double dur, const char* unit,
               double host_ts) {
    json::Value::Object args = {{"step", json::Value::number(1)},
                                {"unit", json::Value::string(unit)},
                                {"phase", json::Value::string("forward")}};
    if (host_ts >= 0) args.emplace_back("host_ts", json::Value::number(host_ts));
    return json::Value::object({{"ph", json::Value::string("X")},
                                {"name", json::Value::string(name)},
                                {"cat", json::Value::string(cat)},
                                {"ts", json::Value::number(ts)},
                                {"dur", json::Value::number(dur)},
                                {"pid", json::Value::number(0)},
                                {"tid", json::Value::number(tid)},
                                {"args", json::Value::object(args)}});
  };
  json::Value::Array events = {
      ev("step 1", "step", 0, -500, 8000, "", -1),
      ev("fwd u0", "forward", 1, 0, 1000, "u0", -400),
      ev("wait all_gather u1", "wait_all_gather", 1, 1000, 2000, "u1", 500),
      ev("fwd u1", "forward", 1, 3000, 1000, "u1", 600),
      ev("all_gather u1", "all_gather", 2, 800, 2200, "u1", 400),
      ev("fwd u2", "forward", 1, 6000, 1000, "u2", 5990),
      // Host track: the host issued u0 at -450 and finished issuing u2 at 6000.
      ev("fwd u0", "forward", 0, -450, 60, "u0", -1),
      ev("fwd u2", "forward", 0, 5980, 20, "u2", -1),
  };
  json::Value::Array units;
  for (const char* n : {"u0", "u1", "u2"})
    units.push_back(json::Value::object({{"name", json::Value::string(n)},
                                         {"all_gather_bytes", json::Value::number(64 << 20)}}));
  const json::Value doc = json::Value::object(
      {{"otherData", json::Value::object({{"flatshard_trace", json::Value::number(1)},
                                          {"rank", json::Value::number(0)},
                                          {"world_size", json::Value::number(2)},
                                          {"device", json::Value::string("cuda:0")},
                                          {"forward_prefetch", json::Value::number(1)},
                                          {"backward_prefetch", json::Value::number(1)},
                                          {"units", json::Value::array(units)}})},
       {"traceEvents", json::Value::array(events)}});
  const TraceSummary s = summarize(read_traces(doc));
  INFO(s.to_string());
  REQUIRE(s.gpu);
  REQUIRE(s.units.size() == 3);
  CHECK(s.units[1].all_gather_forward_us == Approx(2000));
  CHECK(s.units[2].host_gap_us == Approx(2000));
  CHECK(s.units[0].host_gap_us == 0);  // first event of the step: nothing before it
  REQUIRE(s.offenders.size() == 2);
  CHECK(s.units[s.offenders[0]].advice.find("raise forward_prefetch (now 1)") != std::string::npos);
  CHECK(s.units[s.offenders[1]].advice.find("host-bound") != std::string::npos);
  REQUIRE(s.largest_gaps.size() == 2);
  CHECK(s.largest_gaps[0].us == Approx(2000));
  CHECK(s.host_issue_us == Approx(6450));  // -450 .. 6000
  CHECK(s.gpu_span_us == Approx(7000));    // 0 .. 7000 (u2's forward ends last)
  CHECK_THAT(s.to_string(), Catch::Contains("host issue time per step 6.45 ms vs GPU time per step 7.00 ms"));
}

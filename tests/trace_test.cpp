// Per-unit traces (fsdp/trace.h) and their summary (planner/trace_summary.h), label diagnostics.
//
// CPU, ranks as threads: the trace files must be valid JSON (read with nlohmann-json's parser,
// not with the summary's reader; names spelled out here, not taken from fsdp/trace_format.h),
// keep unit names with JSON's special characters, hold exactly the expected events per unit and
// step, nest
// properly on the host track (Perfetto draws misnested slices wrongly), and agree with the
// runtime's counters. The summary must find a planted delay — a Communicator decorator that
// slows every all-gather of one unit — and name that unit first. The GPU analysis (waits and
// host-starved gaps) is checked on a hand-made GPU trace.
#include <catch2/catch.hpp>

#include <torch/nn/modules/linear.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include "models/gpt.h"
#include "collectives/thread_communicator.h"
#include "fsdp/call.h"
#include "fsdp/sharded_model.h"
#include "fsdp/trace.h"
#include "planner/trace_summary.h"
#include "wrap_policies/policy.h"
#include "wrap_policies/spec.h"
#include "rank_require.h"

using namespace flatshard;
namespace g = flatshard::gpt;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

fs::path temp_dir(const std::string& name) {
  fs::path p = fs::temp_directory_path() /
               ("flatshard_diag_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

json parse_file(const std::string& path) {
  std::ifstream f(path);
  REQUIRE(f.good());
  return json::parse(f);  // throws on invalid JSON
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
    RANK_REQUIRE(fsdp->tracer() != nullptr);
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
std::map<int, Counts> count_events(const json& doc) {
  std::map<int, Counts> out;
  for (const auto& e : doc.at("traceEvents")) {
    if (e.at("ph").get<std::string>() != "X") continue;
    const auto& args = e.at("args");
    const int step = args.at("step").get<int>();
    const std::string cat = e.at("cat").get<std::string>();
    std::string key = cat;
    if (cat == "all_gather") key += "/" + args.at("phase").get<std::string>();
    out[step][{args.value("unit", ""), key}] += 1;
  }
  return out;
}

// Host-track events must nest: each starts after the enclosing one and ends before it does.
void require_nested(const json& doc) {
  std::vector<std::pair<double, double>> spans;
  for (const auto& e : doc.at("traceEvents"))
    if (e.at("ph").get<std::string>() == "X" && e.at("tid").get<int>() == 0)
      spans.emplace_back(e.at("ts").get<double>(),
                         e.at("ts").get<double>() + e.at("dur").get<double>());
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
// `numel` elements (and, with `reduce_delay`, every reduce-scatter whose input has): a slow
// link or straggler, planted on one unit.
class DelayingCommunicator final : public Communicator {
 public:
  DelayingCommunicator(Communicator& inner, int64_t numel, std::chrono::milliseconds delay,
                       std::chrono::milliseconds reduce_delay = std::chrono::milliseconds(0))
      : inner_(inner), numel_(numel), delay_(delay), reduce_delay_(reduce_delay) {}
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
    if (in.numel() == numel_) std::this_thread::sleep_for(reduce_delay_);
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
  std::chrono::milliseconds delay_, reduce_delay_;
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
    const json doc = parse_file(file);
    const auto& other = doc.at("otherData");
    CHECK(other.at("rank").get<int>() == rank);
    CHECK(other.at("world_size").get<int>() == 2);
    CHECK(other.at("units").size() == 3);
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
    for (const auto& e : doc.at("traceEvents"))
      if (e.at("ph").get<std::string>() == "X" && e.at("cat").get<std::string>() == "all_gather" &&
          e.at("args").at("step").get<int>() == 2)
        ag_bytes += e.at("args").at("bytes").get<int64_t>();
    const auto& units = other.at("units");
    int64_t counted = 0;  // the runtime's all-gathers of step 2 times each unit's bytes
    for (size_t i = 0; i < units.size(); ++i) {
      const auto& c = counters.at(0).per_unit.at(i);
      counted += (c.forward_all_gathers + c.backward_all_gathers) *
                 units[i].at("all_gather_bytes").get<int64_t>();
    }
    CHECK(ag_bytes == counted);
  }
}

TEST_CASE("trace: a write that fails midway leaves the earlier file as it was",
          "[diagnostics][trace]") {
  // support/output_file.h: the trace goes to a temporary renamed over the path. A file-size
  // limit (EFBIG past 64 bytes; SIGXFSZ ignored) fails the write after it began: the earlier
  // file must survive whole, and the error must name the rank. (Written in place, the path was
  // truncated to the limit.)
  const auto dir = temp_dir("whole");
  const std::string path = (dir / "t.json").string();
  const std::string earlier = "{\"an earlier trace\": true}\n";
  { std::ofstream(path) << earlier; }
  run_ranks(1, [&](Communicator& comm) {
    auto model = g::GPT(g::GPTConfig::preset("tiny"), 0);
    ShardingOptions o;
    o.trace.path = path;
    auto fsdp = fully_shard(model.ptr(), make_plan(*model, parse_policy("type=Block")), comm, o);
    auto [x, y] = g::synthetic_batch(model->config(), 2, 3, comm.rank(), 0);
    flatshard::enter(model, [&, &x = x, &y = y] { return model->loss(x, y); }).backward();
    rlimit before{};
    RANK_REQUIRE(::getrlimit(RLIMIT_FSIZE, &before) == 0);
    auto* old_handler = ::signal(SIGXFSZ, SIG_IGN);
    rlimit small = before;
    small.rlim_cur = 64;
    RANK_REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
    std::string error;
    try {
      fsdp->write_trace();
    } catch (const std::exception& e) {
      error = e.what();
    }
    ::setrlimit(RLIMIT_FSIZE, &before);
    ::signal(SIGXFSZ, old_handler);
    std::ifstream in(path);
    const std::string now((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    RANK_CHECK(now == earlier);
    RANK_CHECK(error.find("flatshard trace (rank 0) '" + path + "'") != std::string::npos);
  });  // the destructor's write, under no limit, replaces it with the trace
  CHECK(parse_file(path).at("otherData").at("rank").get<int>() == 0);
}

TEST_CASE("trace: a unit entered twice per forward has one backward span",
          "[diagnostics][trace]") {
  const auto dir = temp_dir("grouped");
  const std::string path = (dir / "t.json").string();
  train_tiny_traced(2, "every=2,type=Block", path, 2);
  const json doc = parse_file(trace_file_for_rank(path, 0, 2));
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
  const auto doc = parse_file((dir / "t_1.json").string());
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
    RANK_REQUIRE(fsdp->units()[3].name == "l2");
    RANK_REQUIRE(fsdp->units()[3].padded_numel == target);
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
  // Host time of the hooks: the two delayed all-gathers run inside them on CPU (40 ms each per
  // step), whichever unit's hook issued them (a prefetch counts for the issuer).
  double host = 0;
  for (const auto& u : s.units) host += u.host_us;
  CHECK(host >= 0.9 * 80000);

  // A merged file reads back as the same two ranks.
  const json merged = merge_traces({parse_file(trace_file_for_rank(path, 0, 2)),
                                    parse_file(trace_file_for_rank(path, 1, 2))});
  const auto again = read_traces(json::parse(merged.dump()));
  REQUIRE(again.size() == 2);
  CHECK(summarize(again).units[s.offenders.front()].unit == "l2");
}

TEST_CASE("hook clock: the counters hold each unit's host time in its hooks, counted once",
          "[diagnostics][trace]") {
  // UnitCounters::host_{forward,backward}_ns, what the machine profile's host cost per unit is
  // fitted from. l2's all-gathers and its reduce-scatter sleep 30 ms each (CPU collectives run
  // inside the hooks): forward holds one delay, backward two (the gather, wherever a prefetch
  // issued it, and l2's own reduction), and neither can exceed the wall time of the pass it is
  // in — a reduction counted both in the gradient hook and in the post-backward it runs would.
  const int64_t target = 128;  // l2's padded size at world 2 (see the planted-delay case)
  const auto ms = std::chrono::milliseconds(30);
  const double delay_ns = 30e6;
  run_ranks(2, [&](Communicator& inner) {
    DelayingCommunicator comm(inner, target, ms, ms);
    torch::manual_seed(0);
    auto model = Chain();
    auto fsdp = fully_shard(model.ptr(), make_plan(*model, parse_policy("type=Linear")), comm,
                            ShardingOptions{});
    RANK_REQUIRE(fsdp->units()[3].name == "l2");
    for (int step = 0; step < 3; ++step) {
      fsdp->reset_counters();
      for (const UnitCounters& c : fsdp->counters().per_unit)
        RANK_CHECK(c.host_forward_ns + c.host_backward_ns == 0);
      at::Tensor x = at::randn({4, 8});
      const auto t0 = std::chrono::steady_clock::now();
      at::Tensor loss = flatshard::enter(model, [&] { return model->forward(x); });
      const auto t1 = std::chrono::steady_clock::now();
      loss.backward();
      const auto t2 = std::chrono::steady_clock::now();
      const double fwd_wall = std::chrono::duration<double, std::nano>(t1 - t0).count();
      const double bwd_wall = std::chrono::duration<double, std::nano>(t2 - t1).count();
      const StepCounters c = fsdp->counters();
      const auto fwd = static_cast<double>(c.total.host_forward_ns);
      const auto bwd = static_cast<double>(c.total.host_backward_ns);
      RANK_CHECK(fwd >= 0.95 * delay_ns);
      RANK_CHECK(fwd <= fwd_wall);
      RANK_CHECK(bwd >= 0.95 * 2 * delay_ns);
      RANK_CHECK(bwd <= bwd_wall);
      RANK_CHECK(static_cast<double>(c.per_unit[3].host_backward_ns) >= 0.95 * delay_ns);
      for (size_t u = 1; u < c.per_unit.size(); ++u) {  // every Linear's hooks ran
        RANK_CHECK(c.per_unit[u].host_forward_ns > 0);
        RANK_CHECK(c.per_unit[u].host_backward_ns > 0);
      }
    }
  });
}

TEST_CASE("trace summary: GPU waits and host-starved gaps", "[diagnostics][trace]") {
  // A hand-made GPU trace of one rank, step 1 (step 0 is warm-up and ignored). Compute stream
  // (tid 1): u0 forward 0-1000; u1 waits 1000-3000 for its all-gather, then runs 3000-4000;
  // u2 starts at 6000, recorded by the host at 5990 (the GPU was idle 4000-6000: host-bound).
  auto ev = [](const char* name, const char* cat, int tid, double ts, double dur, const char* unit,
               double host_ts) {
    json args = {{"step", 1}, {"unit", unit}, {"phase", "forward"}};
    if (host_ts >= 0) args["host_ts"] = host_ts;
    return json{{"ph", "X"}, {"name", name}, {"cat", cat}, {"ts", ts},
                {"dur", dur}, {"pid", 0},     {"tid", tid}, {"args", args}};
  };
  const json events = {
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
  json units = json::array();
  for (const char* n : {"u0", "u1", "u2"})
    units.push_back({{"name", n}, {"all_gather_bytes", 64 << 20}});
  const json doc = {{"otherData",
                     {{"flatshard_trace", 1},
                      {"rank", 0},
                      {"world_size", 2},
                      {"device", "cuda:0"},
                      {"forward_prefetch", 1},
                      {"backward_prefetch", 1},
                      {"units", units}}},
                    {"traceEvents", events}};
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

TEST_CASE("trace: unit names with JSON's special characters survive the file",
          "[diagnostics][trace]") {
  // Module names are any bytes but '.': quotes, backslashes, control characters, non-ASCII and
  // bytes that are not UTF-8 (written as U+FFFD, so the file stays valid JSON) must come back
  // as the names they are, in otherData.units and on every event.
  const std::vector<std::pair<std::string, std::string>> names = {  // module name, name read
      {"quote\"d", "quote\"d"},
      {"back\\slash", "back\\slash"},
      {"tab\tnew\nline\x01", "tab\tnew\nline\x01"},
      {"caf\xc3\xa9", "caf\xc3\xa9"},
      {"bad\xff", "bad\xef\xbf\xbd"}};
  struct OddImpl : torch::nn::Module {
    explicit OddImpl(const std::vector<std::pair<std::string, std::string>>& names) {
      for (const auto& n : names)
        layers.push_back(register_module(n.first, torch::nn::Linear(4, 4)));
    }
    at::Tensor forward(at::Tensor x) {
      for (auto& l : layers) x = at::tanh(flatshard::call(l, x));
      return x.pow(2).mean();
    }
    std::vector<torch::nn::Linear> layers;
  };
  const auto dir = temp_dir("names");
  const std::string path = (dir / "t.json").string();
  run_ranks(1, [&](Communicator& comm) {
    auto model = std::make_shared<OddImpl>(names);
    ShardingOptions o;
    o.trace.path = path;
    auto fsdp = fully_shard(model, make_plan(*model, parse_policy("type=Linear")), comm, o);
    for (int step = 0; step < 2; ++step) {
      at::Tensor x = at::randn({2, 4});
      flatshard::enter(model, [&] { return model->forward(x); }).backward();
    }
  });
  const json doc = parse_file(path);
  std::set<std::string> want, listed, on_events, summarized;  // the root unit left out
  for (const auto& n : names) want.insert(n.second);
  for (const auto& u : doc.at("otherData").at("units"))
    listed.insert(u.at("name").get<std::string>());
  for (const auto& e : doc.at("traceEvents"))
    if (e.at("ph").get<std::string>() == "X" && e.at("args").contains("unit"))
      on_events.insert(e.at("args").at("unit").get<std::string>());
  for (const auto& u : summarize(read_trace_files({path})).units) summarized.insert(u.unit);
  for (auto* got : {&listed, &on_events, &summarized}) got->erase("<root>");
  CHECK(listed == want);
  CHECK(on_events == want);
  CHECK(summarized == want);
}

TEST_CASE("trace summary: what is not a flatshard trace of this version is refused",
          "[diagnostics][trace]") {
  using Catch::Contains;
  json doc = {{"otherData", {{"flatshard_trace", 1}, {"rank", 0}}},
              {"traceEvents", json::array()}};
  CHECK(read_traces(doc).size() == 1);  // the smallest trace there is
  CHECK_THROWS_WITH(read_traces(json::object()), Contains("not a Chrome trace"));
  const json no_other = {{"traceEvents", json::array()}};
  CHECK_THROWS_WITH(read_traces(no_other), Contains("not a flatshard trace"));
  const json no_marker = {{"otherData", {{"rank", 0}}}, {"traceEvents", json::array()}};
  CHECK_THROWS_WITH(read_traces(no_marker), Contains("no otherData.flatshard_trace"));
  doc["otherData"]["flatshard_trace"] = 2;
  CHECK_THROWS_WITH(read_traces(doc), Contains("version 2: this reader reads version 1"));
  doc["otherData"]["flatshard_trace"] = 1;
  doc["otherData"].erase("rank");
  CHECK_THROWS_WITH(read_traces(doc), Contains("expected a number 'rank', got nothing"));
  // An event of a rank the metadata does not hold.
  const json stray = {{"otherData", {{"flatshard_trace", 1}, {"rank", 0}}},
                      {"traceEvents", {{{"ph", "X"}, {"pid", 3}, {"ts", 0}}}}};
  CHECK_THROWS_WITH(read_traces(stray), Contains("pid 3 without rank metadata"));
  // Files: the error names the file.
  const auto dir = temp_dir("refused");
  const std::string bad = (dir / "bad.json").string();
  std::ofstream(bad) << "{\"traceEvents\": [";
  CHECK_THROWS_WITH(read_trace_files({bad}), Contains(bad + ": not valid JSON"));
  const std::string other = (dir / "other.json").string();
  std::ofstream(other) << "{\"traceEvents\": []}";
  CHECK_THROWS_WITH(read_trace_files({other}), Contains(other + ": not a flatshard trace"));
  CHECK_THROWS_WITH(read_trace_files({(dir / "missing.json").string()}), Contains("cannot open"));
}

TEST_CASE("trace summary: host time of the hooks per unit, by unit kind", "[diagnostics][trace]") {
  // Per-leaf tiny GPT at world 2: the kinds are the member modules' types, with as many units
  // as the plan has of each; each unit's host time is the sum of its hooks' top-level spans.
  const auto dir = temp_dir("kinds");
  const std::string path = (dir / "t.json").string();
  const std::string spec = "type=Linear|LayerNorm|Embedding";
  train_tiny_traced(2, spec, path, 3);
  auto model = g::GPT(g::GPTConfig::preset("tiny"), 0);
  const Plan plan = make_plan(*model, parse_policy(spec));
  std::map<std::string, int> want;  // kind -> units, from the plan and the model
  std::map<std::string, const torch::nn::Module*> modules;
  for (const auto& m : model->named_modules()) modules[m.key()] = m.value().get();
  for (const auto& u : plan.units)
    want[u.is_root ? "<root>" : policy_type_name(modules.at(u.module_paths.front())->name())] += 1;
  const TraceSummary s =
      summarize(read_trace_files({trace_file_for_rank(path, 0, 2), trace_file_for_rank(path, 1, 2)}));
  INFO(s.to_string());
  std::map<std::string, int> got;
  for (const auto& k : s.host_by_kind) {
    got[k.kind] = k.units;
    CHECK(k.median_us > 0);
    CHECK(k.max_us >= k.median_us);
  }
  CHECK(got == want);
  // Kinds as a policy writes the type (issue 33), never LibTorch's class name.
  CHECK(got.count("Linear"));
  CHECK_FALSE(got.count("torch::nn::LinearImpl"));
  for (const auto& u : s.units) {
    CAPTURE(u.unit);
    CHECK(u.host_us > 0);
    double phases = 0;
    for (const auto& [phase, us] : u.host_by_phase) phases += us;
    CHECK(phases == Approx(u.host_us));
    CHECK(u.host_by_phase.count("pre_forward"));
  }
  CHECK(s.to_string().find("by unit kind") != std::string::npos);
}

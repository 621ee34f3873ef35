// flatshard/tools/train_loop.cpp — see train_loop.h for the contract.
#include "tools/train_loop.h"

#include <c10/util/Exception.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/file_io.h"
#include "fsdp/call.h"
#include "optim/fused_adamw.h"
#include "fsdp/meta_init.h"
#include "fsdp/resolve.h"
#include "fsdp/sharded_model.h"
#include "models/family.h"
#include "models/hf.h"
#include "models/hf_config.h"
#include "profiling/counting_allocator.h"
#include "support/format.h"
#include "support/input_file.h"
#include "support/json.h"
#include "cli/named_plans.h"
#include "tools/train_plot.h"
#include "wrap_policies/policy.h"
#include "wrap_policies/spec.h"

namespace flatshard {
namespace train {

namespace {

constexpr const char* kCheckpointPrefix = "step-";

std::string checkpoint_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%s%08lld", kCheckpointPrefix, static_cast<long long>(step));
  return buf;
}

// "step-" and 8 or more digits: the names this tool gives (side directories of an interrupted
// save, "<name>.flatshard-...", are not checkpoints).
bool is_checkpoint_name(const std::string& n) {
  const size_t p = std::string(kCheckpointPrefix).size();
  return n.size() >= p + 8 && n.compare(0, p, kCheckpointPrefix) == 0 &&
         n.find_first_not_of("0123456789", p) == std::string::npos;
}

std::vector<std::string> checkpoint_names(const std::string& folder) {
  std::vector<std::string> names;
  if (!path_exists(folder)) return names;
  for (const auto& n : list_dir(folder))
    if (is_checkpoint_name(n)) names.push_back(n);
  // Same width for steps below 10^8, so byte order is step order; longer names sort after.
  std::sort(names.begin(), names.end(), [](const std::string& a, const std::string& b) {
    return a.size() != b.size() ? a.size() < b.size() : a < b;
  });
  return names;
}

models::ModelConfig model_config(const TrainConfig& c) {
  if (!c.hf_dir.empty()) {
    models::ModelConfig m = models::hf_config(c.hf_dir);
    m.sizes().fp8 = c.model.fp8;
    return m;
  }
  models::ModelConfig m = c.model.config("tiny");
  m.validate();
  return m;
}

Plan make_train_plan(const TrainConfig& c, const torch::nn::Module& model,
                     const models::FamilyModules& modules) {
  std::optional<std::string> named;
  try {
    named = tools::named_plan_spec(c.policy, "type=" + modules.layer_type,
                                   "type=" + modules.leaf_types);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, "--policy ", e.what());
  }
  TORCH_CHECK(!named || !named->empty(), "--policy local: flatshard-train always shards; use ",
              "'model' for one unit");
  const std::string spec = named ? *named : c.policy;
  return make_plan(model, spec == "none" ? Policy{} : parse_policy(spec));
}

double mean_over_ranks(Communicator& comm, double v) {
  // fp32, the dtype every backend reduces; the sum's order is fixed, so the result is too.
  at::Tensor t = at::full({1}, v, at::TensorOptions().dtype(at::kFloat).device(comm.device()));
  comm.all_reduce(t, ReduceOp::kSum, comm.current_stream());
  return t.item<double>() / comm.world_size();
}

std::string format_eta(double s) {
  const auto t = static_cast<int64_t>(s + 0.5);
  char buf[32];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%lldh%02lldm", static_cast<long long>(t / 3600),
                  static_cast<long long>(t % 3600 / 60));
  else
    std::snprintf(buf, sizeof buf, "%lldm%02llds", static_cast<long long>(t / 60),
                  static_cast<long long>(t % 60));
  return buf;
}

c10::Device model_device(const torch::nn::Module& m) {
  const auto params = m.parameters();
  return params.empty() ? c10::Device(c10::kCPU) : params.front().device();
}

// A measured value for metrics.jsonl: JSON has no NaN or infinity, and a diverged step (a NaN
// loss or gradient norm) must be logged, not end the run at the write: those are null.
std::string metric(double v) { return std::isfinite(v) ? json::number(v) : "null"; }

std::string format_lr(double lr) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", lr);
  return buf;
}

// Rank 0's metrics file: one JSON object per line, flushed as written.
class Metrics {
 public:
  explicit Metrics(const std::string& path) : path_(path) {
    f_ = std::fopen(path.c_str(), "a");
    TORCH_CHECK(f_ != nullptr, "metrics file '", printable_escape(path),
                "': cannot open for appending: ", std::strerror(errno));
  }
  ~Metrics() {
    // fclose of a file we flushed after every line: nothing left to report.
    if (f_) std::fclose(f_);
  }
  void line(const std::string& s) {
    TORCH_CHECK(std::fputs((s + "\n").c_str(), f_) >= 0 && std::fflush(f_) == 0, "metrics file '",
                printable_escape(path_), "': write failed: ", std::strerror(errno));
  }

 private:
  std::string path_;
  FILE* f_ = nullptr;
};

// The whole run's loss curve from metrics.jsonl: every step's last logged loss since the last
// fresh start (a resumed run re-logs the steps after its checkpoint; the later value is the
// one the run continued from). `fallback` (this process's steps) when the file is too large to
// read or unreadable: the curve is a convenience, never a reason to fail a finished run.
std::vector<std::pair<int64_t, double>> run_curve(
    const std::string& path, const std::vector<std::pair<int64_t, double>>& fallback) {
  std::map<int64_t, double> by_step;
  try {
    const std::string text = read_input_file(path, int64_t{256} << 20, "metrics file");
    std::istringstream in(text);
    std::string line;
    while (std::getline(in, line)) {
      const json::Json j = json::parse(line, path);
      if (j.contains("event") && j["event"] == "start") by_step.clear();
      if (j.contains("loss") && j["loss"].is_number())
        by_step[j["step"].get<int64_t>()] = j["loss"].get<double>();
    }
  } catch (const std::exception&) {
    return fallback;
  }
  return {by_step.begin(), by_step.end()};
}

}  // namespace

const char* decay_name(Decay d) {
  return d == Decay::kCosine ? "cosine" : d == Decay::kLinear ? "linear" : "constant";
}

double lr_at(const Schedule& s, int64_t step) {
  if (step < s.warmup) return s.lr * static_cast<double>(step + 1) / static_cast<double>(s.warmup);
  if (s.decay == Decay::kConstant) return s.lr;
  if (step >= s.steps) return s.min_lr;
  const double r = static_cast<double>(step - s.warmup) / static_cast<double>(s.steps - s.warmup);
  if (s.decay == Decay::kLinear) return s.lr - (s.lr - s.min_lr) * r;
  return s.min_lr + (s.lr - s.min_lr) * 0.5 * (1.0 + std::cos(M_PI * r));
}

std::string latest_checkpoint(const std::string& out) {
  const std::string folder = out + "/checkpoints";
  const auto names = checkpoint_names(folder);
  for (auto it = names.rbegin(); it != names.rend(); ++it)
    if (path_exists(folder + "/" + *it + "/" + kManifestName)) return folder + "/" + *it;
  return "";
}

namespace {

// Where a run starts: with --resume, the step of the checkpoint (*dir), after checking it is this
// run's (its model, batch and sequence length); else 0, refusing an --out that holds an earlier
// run's checkpoints.
int64_t resume_step(const TrainConfig& c, const models::ModelConfig& cfg, std::string* dir) {
  std::string& resume_dir = *dir;
  int64_t start = 0;
  if (!c.resume.empty()) {
    resume_dir = c.resume == "latest" ? latest_checkpoint(c.out) : c.resume;
    TORCH_CHECK(!resume_dir.empty(), "--resume latest: no complete checkpoint in '",
                printable_escape(c.out), "/checkpoints'");
    const Manifest m = read_manifest(resume_dir);
    const std::string where = "resume checkpoint '" + printable_escape(resume_dir) + "'";
    TORCH_CHECK(m.training_state.has_value(), where,
                ": has no training state (not written by flatshard-train)");
    const json::Json doc = json::parse(*m.training_state, where);
    const json::Node st(doc, where + ": training_state");
    const std::string saved_model = st.at("model").as_string();
    TORCH_CHECK(saved_model == cfg.to_string(), where, ": trained model '",
                printable_escape(saved_model), "', this run's is '", cfg.to_string(), "'");
    const int64_t saved_seq = st.at("data").at("seq_len").as_int();
    const int64_t saved_batch = st.at("data").at("global_batch").as_int();
    TORCH_CHECK(saved_batch == c.global_batch, where, ": global batch ", saved_batch,
                ", this run's is ", c.global_batch, " (the data position counts steps of it)");
    TORCH_CHECK(saved_seq == cfg.seq_len(), where, ": sequence length ", saved_seq,
                ", this run's is ", cfg.seq_len());
    start = st.at("step").as_int();
    TORCH_CHECK(start >= 0 && start <= c.steps, where, ": step ", start, " is not in [0, --steps ",
                c.steps, "]");
  }

  if (resume_dir.empty()) {
    // A fresh run never mixes its checkpoints with an earlier run's: --resume latest would
    // otherwise pick whichever is newest, and the earlier run's would be pruned by --keep.
    const auto earlier = checkpoint_names(c.out + "/checkpoints");
    TORCH_CHECK(earlier.empty(), "--out '", printable_escape(c.out), "' already holds ",
                earlier.size(), " checkpoint(s) of an earlier run (newest ", earlier.back(),
                "): pass --resume to continue it, or another --out");
  }
  return start;
}

// The training state saved with the checkpoint of `step` (docs/training.md "Resume").
std::string training_state(const TrainConfig& c, const models::ModelConfig& cfg,
                           const data::TokenDataset& train_data, int64_t step, int world) {
  std::ostringstream st;
  st << "{\"step\": " << step << ", \"tokens\": " << step * c.global_batch * cfg.seq_len()
     << ", \"model\": " << json::quote(cfg.to_string()) << ", \"data\": {\"seed\": " << c.seed
     << ", \"position\": " << step << ", \"global_batch\": " << c.global_batch
     << ", \"seq_len\": " << cfg.seq_len() << ", \"num_tokens\": " << train_data.num_tokens()
     << "}"
     << ", \"schedule\": {\"lr\": " << json::number(c.schedule.lr)
     << ", \"min_lr\": " << json::number(c.schedule.min_lr)
     << ", \"warmup\": " << c.schedule.warmup
     << ", \"decay\": " << json::quote(decay_name(c.schedule.decay))
     << ", \"steps\": " << c.schedule.steps << "}"
     << ", \"rng\": {\"note\": \"batches are a pure function of (data.seed, step); the model "
        "has no dropout\"}, \"world\": "
     << world << "}";
  return st.str();
}

// The run's first metrics line and progress line (rank 0).
void announce_start(const TrainConfig& c, const models::ModelConfig& cfg,
                    const data::TokenDataset& train_data, const ShardedModel& fsdp,
                    Metrics& metrics, const std::string& resume_dir, int64_t start, int world,
                    int64_t accum) {
  std::ostringstream s;
  s << "{\"event\": " << json::quote(resume_dir.empty() ? "start" : "resume")
    << ", \"step\": " << start << ", \"world\": " << world
    << ", \"checkpoint\": " << json::quote(resume_dir) << "}";
  metrics.line(s.str());
  std::cout << "flatshard-train: " << cfg.family().display_name() << " "
            << format_fixed(static_cast<double>(cfg.num_parameters()) / 1e6, 2)
            << " M parameters, " << fsdp.num_units() << " units, world " << world << ", "
            << train_data.num_tokens() << " tokens in " << train_data.files().size()
            << " file(s); steps " << start << ".." << c.steps << ", global batch "
            << c.global_batch << " x " << cfg.seq_len() << " tokens, accumulation " << accum
            << (resume_dir.empty() ? "" : ", resumed from " + printable_escape(resume_dir))
            << std::endl;
}

// AdamW or FusedAdamW over the model's masters. Note [Offload step in backward] / Note
// [Compute copy in the step]: those units step through an attached FusedAdamW (train_main
// refuses --offload-step modes without --optimizer fused), as flatshard-bench's runs do.
std::shared_ptr<torch::optim::AdamW> make_optimizer(const TrainConfig& c, const ShardingOptions& so,
                                                    ShardedModel& fsdp) {
  auto adamw = torch::optim::AdamWOptions(c.schedule.lr)
                   .betas({c.beta1, c.beta2})
                   .eps(c.eps)
                   .weight_decay(c.weight_decay);
  if (c.optimizer != "fused")
    return std::make_shared<torch::optim::AdamW>(fsdp.parameters(), adamw);
  auto opt = std::make_shared<FusedAdamW>(fsdp.parameters(), adamw);
  const auto units = fsdp.units();
  if (so.offload_step != OffloadStep::kAfterBackward ||
      std::any_of(units.begin(), units.end(), [](const UnitInfo& u) { return u.step_copy; }))
    fsdp.attach_optimizer(opt);
  return opt;
}

// One step's numbers, for report_step().
struct StepReport {
  int64_t step, start;
  double loss, lr, grad_norm, secs, train_seconds;
  int64_t peak;
  bool device_memory;
};

// Rank 0: the step's metrics line, and its progress line every --log-every steps (and the first
// and last), with MFU where the peak is known.
void report_step(const TrainConfig& c, const models::ModelConfig& cfg, Metrics& metrics,
                 const StepReport& r, double tps, double elapsed) {
  const std::optional<double> mfu = cli::mfu(tps, cfg.flops_per_token(), c.peak_tflops);
  std::ostringstream s;
  s << "{\"step\": " << r.step + 1 << ", \"loss\": " << metric(r.loss) << ", \"lr\": "
    << metric(r.lr) << ", \"grad_norm\": " << metric(r.grad_norm)
    << ", \"tokens_per_s_per_rank\": " << metric(tps) << ", \"peak_memory_bytes\": " << r.peak
    << ", \"elapsed_s\": " << metric(elapsed);
  if (mfu) s << ", \"mfu\": " << metric(*mfu);
  s << "}";
  metrics.line(s.str());
  const int64_t done = r.step + 1 - r.start;
  if ((r.step + 1) % std::max<int64_t>(c.log_every, 1) != 0 && r.step + 1 != c.steps &&
      r.step != r.start)
    return;
  const double eta =
      r.train_seconds / static_cast<double>(done) * static_cast<double>(c.steps - r.step - 1);
  std::cout << "step " << r.step + 1 << "/" << c.steps << " | loss " << format_fixed(r.loss, 4)
            << " | lr " << format_lr(r.lr) << " | grad norm " << format_fixed(r.grad_norm, 3)
            << " | " << format_fixed(tps, 0) << " tok/s/rank"
            << (mfu ? " | mfu " + format_fixed(*mfu * 100, 2) + "%" : "") << " | peak mem "
            << format_bytes(r.peak) << (r.device_memory ? " (device)" : " (process)") << " | eta "
            << format_eta(eta) << std::endl;
}

}  // namespace

void train_rank(const TrainConfig& c, Communicator& comm, const cli::DeviceHooks& hooks) {
  const int rank = comm.rank(), world = comm.world_size();
  const bool lead = rank == 0;
  const c10::Device dev = comm.device();
  // Peak memory: the device's (hooks) or, on CPU, the process's live CPU tensors.
  profiling::CountingCpuAllocator& mem = profiling::CountingCpuAllocator::install();
  const bool device_memory = static_cast<bool>(hooks.memory_peak);
  auto peak_bytes = [&] { return device_memory ? hooks.memory_peak() : mem.peak_bytes(); };
  auto reset_peak = [&] {
    if (device_memory && hooks.memory_reset_peak) hooks.memory_reset_peak();
    mem.reset_peak();
  };

  // Model, data and the batch layout first: any mistake there is found before anything runs.
  const models::ModelConfig cfg = model_config(c);
  const data::BatchLayout layout{c.global_batch, c.micro_batch, world, rank};
  const int64_t accum = layout.accumulation();
  const data::TokenDataset train_data(c.data, {c.token_dtype, cfg.vocab(), cfg.seq_len()});
  std::unique_ptr<data::TokenDataset> val_data;
  if (!c.val.empty())
    val_data = std::make_unique<data::TokenDataset>(
        c.val, data::TokenDatasetOptions{c.token_dtype, cfg.vocab(), cfg.seq_len()});

  // Resume: which checkpoint, and whether it is this run's (before building anything).
  std::string resume_dir;
  const int64_t start = resume_step(c, cfg, &resume_dir);

  std::shared_ptr<torch::nn::Module> model;
  ShardingOptions so = cli::sharding_options(c.sharding, c10::kFloat);
  if (!c.hf_dir.empty()) {
    MetaInit meta;  // shapes only: each rank reads its shard of the weights
    model = cfg.build(c.seed);
    so.load = models::hf_loader(c.hf_dir, cfg);
  } else {
    model = cfg.build(c.seed);  // on the host, from the seed: the same weights on every device
    if (dev != model_device(*model)) model->to(dev);
  }
  Plan plan = make_train_plan(c, *model, cfg.family().modules());
  if (c.recompute && plan.units.size() > 1) {
    for (UnitSpec& u : plan.units)
      if (!u.is_root) u.options.recompute = true;
  }
  so.offload = c.offload;
  std::unique_ptr<ShardedModel> fsdp = fully_shard(model, plan, comm, so);
  std::shared_ptr<torch::optim::AdamW> opt = make_optimizer(c, so, *fsdp);
  if (!resume_dir.empty()) load_checkpoint(*fsdp, opt.get(), resume_dir);

  std::unique_ptr<Metrics> metrics;
  if (lead) {
    make_dirs(c.out);
    metrics = std::make_unique<Metrics>(c.out + "/metrics.jsonl");
    announce_start(c, cfg, train_data, *fsdp, *metrics, resume_dir, start, world, accum);
  }

  const double tokens_per_step = static_cast<double>(c.global_batch * cfg.seq_len());

  auto evaluate = [&](int64_t step) {
    if (!val_data) return;
    at::NoGradGuard no_grad;
    double sum = 0;
    for (int64_t b = 0; b < c.eval_batches; ++b) {
      auto [x, y] = val_data->eval_batch((b * world + rank) * c.micro_batch, c.micro_batch);
      x = x.to(dev);
      y = y.to(dev);
      sum += enter(model, [&] { return cfg.loss(*model, x, y); }).item<double>();
    }
    const double val = mean_over_ranks(comm, sum / static_cast<double>(c.eval_batches));
    if (lead) {
      metrics->line("{\"step\": " + std::to_string(step) + ", \"val_loss\": " + metric(val) + "}");
      std::cout << "step " << step << "/" << c.steps << " | val loss " << format_fixed(val, 4)
                << std::endl;
    }
  };

  auto save = [&](int64_t step) {
    if (c.out.empty()) return;
    const std::string folder = c.out + "/checkpoints";
    if (lead) make_dirs(folder);
    comm.barrier();
    CheckpointOptions o;
    o.training_state = training_state(c, cfg, train_data, step, world);
    const std::string dir = folder + "/" + checkpoint_name(step);
    save_checkpoint(*fsdp, opt.get(), dir, o);
    if (lead) {
      const auto names = checkpoint_names(folder);
      const int64_t extra = static_cast<int64_t>(names.size()) - std::max<int64_t>(c.keep, 1);
      for (int64_t i = 0; i < extra; ++i) remove_tree(folder + "/" + names[i]);
      std::cout << "step " << step << "/" << c.steps << " | checkpoint " << printable_escape(dir)
                << std::endl;
    }
  };

  std::vector<std::pair<int64_t, double>> curve;
  const auto t_start = std::chrono::steady_clock::now();
  double train_seconds = 0;
  reset_peak();
  for (int64_t step = start; step < c.steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    const double lr = lr_at(c.schedule, step);
    for (auto& g : opt->param_groups())
      static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
    opt->zero_grad();
    double local = 0;
    for (int64_t m = 0; m < accum; ++m) {
      auto [x, y] = train_data.micro_batch(c.seed, step, layout, m);
      x = x.to(dev);
      y = y.to(dev);
      fsdp->set_requires_gradient_sync(m == accum - 1);
      at::Tensor loss = enter(model, [&] { return cfg.loss(*model, x, y); });
      (loss / static_cast<double>(accum)).backward();
      local += loss.item<double>();
    }
    const double grad_norm = fsdp->clip_grad_norm_(c.clip > 0 ? c.clip : INFINITY);
    opt->step();
    const double loss = mean_over_ranks(comm, local / static_cast<double>(accum));
    hooks.synchronize();  // the step's time includes its device work
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    train_seconds += secs;
    if (lead) {
      curve.emplace_back(step + 1, loss);
      report_step(c, cfg, *metrics, StepReport{step, start, loss, lr, grad_norm, secs,
                                               train_seconds, peak_bytes(), device_memory},
                  tokens_per_step / secs / world,
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count());
    }
    const bool last = step + 1 == c.steps;
    if (c.eval_every > 0 && (step + 1) % c.eval_every == 0 && !last) evaluate(step + 1);
    if (last || (c.checkpoint_every > 0 && (step + 1) % c.checkpoint_every == 0)) save(step + 1);
  }
  evaluate(c.steps);
  if (!c.save_hf.empty()) {
    models::save_hf(*fsdp, c.save_hf);
    if (lead)
      std::cout << "saved Hugging Face model to " << printable_escape(c.save_hf) << std::endl;
  }
  if (lead && !curve.empty() && !c.out.empty())
    write_loss_svg(run_curve(c.out + "/metrics.jsonl", curve), c.out + "/loss.svg");
}

}  // namespace train
}  // namespace flatshard

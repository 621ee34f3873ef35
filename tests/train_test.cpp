// flatshard-train (tools/train_main.cpp, tools/train_loop.h) run as a child process on a real
// text prepared byte-level by tools/prepare_tokens.py: a tiny LLaMA at world 2 with
// accumulation and warmup is SIGKILLed mid-run and resumed with --resume, and its losses from
// then on equal an uninterrupted run's bit for bit; the loss falls; a resume at world 1 stays
// within the parity tolerance; bad inputs are one-line errors naming the file and the value.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/file_io.h"
#include "models/family.h"
#include "models/hf.h"
#include "support/json.h"
#include "temp_dir.h"
#include "tool_run.h"

using flatshard_test::run_tool;
using flatshard_test::TempDir;
using flatshard_test::ToolRun;

namespace {

flatshard_test::ToolRunOptions within(int s) {
  flatshard_test::ToolRunOptions o;
  o.seconds = s;
  return o;
}

const std::string kExe = FLATSHARD_TRAIN_EXE;
const std::string kText = "/usr/share/common-licenses/GPL-3";

// Prepares kText byte-level into `dir` with the build's python; train.bin and val.bin.
void prepare(const std::string& scratch, const std::string& dir) {
  const ToolRun r = run_tool(
      scratch, FLATSHARD_PYTHON_EXE,
      {std::string(FLATSHARD_SOURCE_DIR) + "/tools/prepare_tokens.py", "--byte-level", kText, dir});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
}

// The run's flags: a tiny LLaMA (d 32, 2 layers, seq 32) at world 2, 4 micro-batches of 2 per
// step over 2 ranks (accumulation 2), warmup 3 then cosine, a checkpoint every 3 steps.
std::vector<std::string> flags(const std::string& data, const std::string& out, int world,
                               int steps = 18) {
  return {"--data",
          data + "/train.bin",
          "--val",
          data + "/val.bin",
          "--out",
          out,
          "--world",
          std::to_string(world),
          "--d-model",
          "32",
          "--heads",
          "2",
          "--seq",
          "32",
          "--vocab",
          "256",
          "--global-batch",
          "8",
          "--micro-batch",
          "2",
          "--steps",
          std::to_string(steps),
          "--warmup",
          "3",
          "--lr",
          "3e-3",
          "--min-lr",
          "3e-4",
          "--checkpoint-every",
          "3",
          "--keep",
          "2",
          "--log-every",
          "6",
          "--eval-every",
          "9"};
}

// `args` with flag's value replaced by `value`.
std::vector<std::string> with(std::vector<std::string> args, const std::string& flag,
                              const std::string& value) {
  auto it = std::find(args.begin(), args.end(), flag);
  REQUIRE(it != args.end());
  *(it + 1) = value;
  return args;
}

// `args` without `flag` and its value.
std::vector<std::string> without(std::vector<std::string> args, const std::string& flag) {
  auto it = std::find(args.begin(), args.end(), flag);
  REQUIRE(it != args.end());
  args.erase(it, it + 2);
  return args;
}

struct Metrics {
  std::map<int64_t, double> loss;  // after the last start/resume line
  std::map<int64_t, double> lr;
  int64_t resumed_at = -1;  // the last resume line's step, -1 for none
};

Metrics read_metrics(const std::string& path) {
  Metrics m;
  std::istringstream in(flatshard_test::slurp(path));
  std::string line;
  while (std::getline(in, line)) {
    const auto j = flatshard::json::parse(line, path);
    if (j.contains("event")) {
      m.loss.clear();
      m.lr.clear();
      m.resumed_at = j["event"] == "resume" ? j["step"].get<int64_t>() : -1;
    } else if (j.contains("loss")) {
      m.loss[j["step"].get<int64_t>()] = j["loss"].get<double>();
      m.lr[j["step"].get<int64_t>()] = j["lr"].get<double>();
    }
  }
  return m;
}

// Starts the tool; kills it with SIGKILL once `until` exists. Returns true when the kill
// happened (false: the run ended first).
bool run_and_kill(const std::vector<std::string>& args, const std::string& until,
                  const std::string& log) {
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    std::vector<char*> argv{const_cast<char*>(kExe.c_str())};
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
    }
    ::execv(kExe.c_str(), argv.data());
    ::_exit(127);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  int status = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    if (::waitpid(pid, &status, WNOHANG) == pid) return false;  // ended by itself
    if (flatshard::path_exists(until)) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  FAIL("flatshard-train did not reach " << until << " within 120 s");
  return false;
}

}  // namespace

TEST_CASE("flatshard-train: SIGKILL mid-run, --resume continues bit for bit", "[train]") {
  TempDir tmp;
  const std::string data = tmp / "data";
  prepare(tmp.path(), data);

  // The uninterrupted run.
  const ToolRun full = run_tool(tmp.path(), kExe, flags(data, tmp / "full", 2), within(300));
  INFO(full.out << full.err);
  REQUIRE(full.exit_code == 0);
  const Metrics a = read_metrics(tmp / "full/metrics.jsonl");
  REQUIRE(a.loss.size() == 18);
  CHECK(full.out.find("step 6/18 | loss ") != std::string::npos);
  CHECK(full.out.find("val loss") != std::string::npos);
  // The loss falls: the last three steps' mean well below the first step's.
  const double first = a.loss.at(1), last = (a.loss.at(16) + a.loss.at(17) + a.loss.at(18)) / 3;
  CHECK(first > 5.0);  // about ln(256) = 5.55 for a fresh model
  CHECK(last < first - 1.0);
  CHECK(flatshard::path_exists(tmp / "full/loss.svg"));
  // The schedule's closed form: 3 warmup steps to 3e-3, then cosine to 3e-4 at step 18.
  for (const auto& [step, lr] : a.lr) {
    const int64_t s = step - 1;  // 0-based step the optimizer took
    const double want =
        s < 3 ? 3e-3 * static_cast<double>(s + 1) / 3
              : 3e-4 + (3e-3 - 3e-4) * 0.5 * (1 + std::cos(M_PI * static_cast<double>(s - 3) / 15));
    INFO("step " << step);
    CHECK(lr == Approx(want).epsilon(1e-12));
  }
  // --keep 2: only the newest two checkpoints are left.
  CHECK(flatshard::path_exists(tmp / "full/checkpoints/step-00000018"));
  CHECK(flatshard::path_exists(tmp / "full/checkpoints/step-00000015"));
  CHECK_FALSE(flatshard::path_exists(tmp / "full/checkpoints/step-00000012"));

  // The same run, SIGKILLed once step 6's checkpoint is published, then resumed.
  const std::string out = tmp / "killed";
  const bool killed = run_and_kill(
      flags(data, out, 2), out + "/checkpoints/step-00000006/manifest.json", tmp / "killed.log");
  REQUIRE(killed);
  const ToolRun resumed = [&] {
    auto args = flags(data, out, 2);
    args.push_back("--resume");
    return run_tool(tmp.path(), kExe, args, within(300));
  }();
  INFO(resumed.out << resumed.err);
  REQUIRE(resumed.exit_code == 0);
  CHECK(resumed.out.find("resumed from") != std::string::npos);
  const Metrics b = read_metrics(out + "/metrics.jsonl");
  REQUIRE(b.resumed_at >= 6);
  REQUIRE(b.resumed_at < 18);
  REQUIRE(b.loss.size() == static_cast<size_t>(18 - b.resumed_at));
  for (const auto& [step, loss] : b.loss) {
    INFO("step " << step);
    CHECK(loss == a.loss.at(step));  // bit for bit
  }
  // The resumed run's loss curve covers the whole run: a point per step, 18 in all.
  const std::string svg = flatshard_test::slurp(out + "/loss.svg");
  const size_t at = svg.find("points=\"");
  REQUIRE(at != std::string::npos);
  const std::string pts = svg.substr(at, svg.find('"', at + 8) - at);
  CHECK(std::count(pts.begin(), pts.end(), ',') == 18);

  // A resume at world 1 from the uninterrupted run's step-15 checkpoint: the same global batch
  // in another summation order, within the fp32 parity tolerance.
  const ToolRun one = [&] {
    auto args = flags(data, tmp / "one", 1);
    args.push_back("--resume");
    args.push_back(tmp / "full/checkpoints/step-00000015");
    return run_tool(tmp.path(), kExe, args, within(300));
  }();
  INFO(one.out << one.err);
  REQUIRE(one.exit_code == 0);
  const Metrics c = read_metrics(tmp / "one/metrics.jsonl");
  REQUIRE(c.loss.size() == 3);
  for (const auto& [step, loss] : c.loss) CHECK(loss == Approx(a.loss.at(step)).epsilon(1e-4));
}

TEST_CASE("flatshard-train: bad inputs are one-line errors naming the file and the value",
          "[train]") {
  TempDir tmp;
  const std::string data = tmp / "data";
  prepare(tmp.path(), data);
  auto fails = [&](std::vector<std::string> args, int code, const std::string& part) {
    const ToolRun r = run_tool(tmp.path(), kExe, args, within(120));
    INFO(r.out << r.err);
    CHECK(r.exit_code == code);
    CHECK(r.err.find(part) != std::string::npos);
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  };
  // A token >= the vocabulary: byte-level text holds bytes above 100.
  fails(with(flags(data, tmp / "o1", 2, 3), "--vocab", "100"), 1,
        "not below the model's vocabulary size 100");
  {
    const ToolRun r = run_tool(tmp.path(), kExe,
                               with(flags(data, tmp / "o1", 2, 3), "--vocab", "100"), within(120));
    CHECK(r.err.find("token file '" + data + "/train.bin': token ") != std::string::npos);
  }
  // A truncated file (odd size for uint16).
  flatshard_test::write_bytes(tmp / "cut.bin",
                              flatshard_test::read_bytes(data + "/train.bin").substr(0, 4097));
  fails(with(flags(data, tmp / "o2", 2, 3), "--data", tmp / "cut.bin"), 1,
        "cut.bin': 4097 bytes, not a multiple of 2");
  // A FIFO: refused, never waited on.
  REQUIRE(::mkfifo((tmp / "fifo.bin").c_str(), 0600) == 0);
  fails(with(flags(data, tmp / "o3", 2, 3), "--data", tmp / "fifo.bin"), 1,
        "fifo.bin': is a FIFO, not a regular file");
  // A FIFO as the config file: refused before CLI11 would block reading it.
  fails({"--data", data + "/train.bin", "--out", tmp / "o3", "--config", tmp / "fifo.bin"}, 2,
        "config file '" + tmp / "fifo.bin" + "': is a FIFO");
  // A config file with an unknown key: a usage error naming it.
  flatshard_test::write_bytes(tmp / "run.toml", "steps = 2\nlearning_rate = 0.1\n");
  {
    auto f = flags(data, tmp / "o4", 2, 3);
    f.push_back("--config");
    f.push_back(tmp / "run.toml");
    fails(f, 2, "config file '" + tmp / "run.toml" + "': INI was not able to parse learning_rate");
  }
  // Numbers are decimal and finite, as in every tool (cli/numbers.h): a usage error.
  fails(with(flags(data, tmp / "o6", 2, 3), "--lr", "nan"), 2,
        "--lr: expected a decimal number, got 'nan'");
  fails(with(flags(data, tmp / "o6", 2, 3), "--steps", "0x10"), 2,
        "--steps: expected a decimal integer, got '0x10'");
  // A config file sets flags by name; the command line wins (--lr 3e-3 over the file's 1e-3).
  flatshard_test::write_bytes(tmp / "good.toml", "steps = 2\nglobal-batch = 4\nlr = 1e-3\n");
  {
    auto f = without(without(with(flags(data, tmp / "o7", 2), "--warmup", "0"), "--steps"),
                     "--global-batch");
    f.push_back("--config");
    f.push_back(tmp / "good.toml");
    const ToolRun r = run_tool(tmp.path(), kExe, f, within(120));
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(r.out.find("steps 0..2, global batch 4 x 32") != std::string::npos);
    CHECK(read_metrics(tmp / "o7/metrics.jsonl").lr.at(1) == 3e-3);
  }
  // A run that diverges (an absurd learning rate, no clipping) logs its NaN/inf values as null
  // and finishes: metrics.jsonl stays valid JSON.
  {
    auto f = with(with(flags(data, tmp / "o8", 2, 4), "--lr", "1e30"), "--min-lr", "1e29");
    f.push_back("--clip");
    f.push_back("0");
    const ToolRun r = run_tool(tmp.path(), kExe, f, within(120));
    INFO(r.out << r.err);
    CHECK(r.exit_code == 0);
    const std::string text = flatshard_test::slurp(tmp / "o8/metrics.jsonl");
    CHECK(text.find("\"loss\": null") != std::string::npos);
    std::istringstream in(text);
    std::string line;
    while (std::getline(in, line)) CHECK_NOTHROW(flatshard::json::parse(line));
  }
  // A resume directory from another model: names both; the checkpoint is untouched.
  {
    auto f = flags(data, tmp / "o5", 2, 3);
    const ToolRun r = run_tool(tmp.path(), kExe, f, within(120));
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    const std::string before =
        flatshard_test::read_bytes(tmp / "o5/checkpoints/step-00000003/manifest.json");
    f.push_back("--layers");
    f.push_back("3");
    f.push_back("--resume");
    fails(f, 1, "trained model '");
    CHECK(flatshard_test::read_bytes(tmp / "o5/checkpoints/step-00000003/manifest.json") == before);
    // A fresh run into a folder that holds an earlier run's checkpoints: refused, untouched.
    fails(flags(data, tmp / "o5", 2, 3), 1,
          "already holds 1 checkpoint(s) of an earlier run (newest step-00000003)");
    CHECK(flatshard_test::read_bytes(tmp / "o5/checkpoints/step-00000003/manifest.json") == before);
  }
}

namespace {

at::Tensor read_raw(const std::string& path, std::vector<int64_t> shape, at::ScalarType dtype) {
  const std::string bytes = flatshard_test::read_bytes(path);
  at::Tensor t = at::empty(shape, dtype);
  REQUIRE(bytes.size() == static_cast<size_t>(t.nbytes()));
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

}  // namespace

TEST_CASE("flatshard-train: a Hugging Face directory, resumed, saved back for transformers",
          "[train]") {
  TempDir tmp;
  const std::string data = tmp / "data";
  prepare(tmp.path(), data);  // GPL-3 is ASCII: every byte is below the model's vocabulary 128
  // transformers' own tiny random LLaMA (the sizes of tests/hf_reference.py's llama2 case:
  // vocab 128, d 64, 2 layers, 4 heads, 2 key/value heads), written by save_pretrained.
  const std::string hf = tmp / "llama";
  const std::string script =
      "import sys, torch\n"
      "from transformers import LlamaConfig, LlamaForCausalLM\n"
      "torch.manual_seed(0)\n"
      "c = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,"
      " num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)\n"
      "LlamaForCausalLM(c).save_pretrained(sys.argv[1])\n";
  flatshard_test::write_bytes(tmp / "make_llama.py", script);
  const int rc = std::system((std::string(FLATSHARD_PYTHON_EXE) + " -W ignore " +
                              tmp / "make_llama.py" + " " + hf + " > " + tmp / "ref.log" + " 2>&1")
                                 .c_str());
  INFO(flatshard_test::slurp(tmp / "ref.log"));
  REQUIRE(rc == 0);
  auto hf_flags = [&](const std::string& out, int world) {
    return std::vector<std::string>{"--hf",
                                    hf,
                                    "--data",
                                    data + "/train.bin",
                                    "--out",
                                    out,
                                    "--world",
                                    std::to_string(world),
                                    "--global-batch",
                                    "4",
                                    "--micro-batch",
                                    "1",
                                    "--steps",
                                    "6",
                                    "--warmup",
                                    "2",
                                    "--lr",
                                    "3e-3",
                                    "--checkpoint-every",
                                    "3",
                                    "--log-every",
                                    "3"};
  };
  auto a_flags = hf_flags(tmp / "a", 2);
  a_flags.push_back("--save-hf");
  a_flags.push_back(tmp / "exported");
  const ToolRun a = run_tool(tmp.path(), kExe, a_flags, within(300));
  INFO(a.out << a.err);
  REQUIRE(a.exit_code == 0);
  const Metrics ma = read_metrics(tmp / "a/metrics.jsonl");
  REQUIRE(ma.loss.size() == 6);
  CHECK(ma.loss.at(6) < ma.loss.at(1));

  // Resumed from step 3 (another --out): steps 4..6 bit for bit.
  auto b_flags = hf_flags(tmp / "b", 2);
  b_flags.push_back("--resume");
  b_flags.push_back(tmp / "a/checkpoints/step-00000003");
  const ToolRun b = run_tool(tmp.path(), kExe, b_flags, within(300));
  INFO(b.out << b.err);
  REQUIRE(b.exit_code == 0);
  const Metrics mb = read_metrics(tmp / "b/metrics.jsonl");
  REQUIRE(mb.loss.size() == 3);
  for (const auto& [step, loss] : mb.loss) CHECK(loss == ma.loss.at(step));

  // --save-hf: transformers' logits of the exported model equal flatshard's of the final
  // checkpoint (loaded into a plain module).
  const flatshard::models::ModelConfig cfg = flatshard::models::hf_config(tmp / "exported");
  auto model = cfg.build(0);
  flatshard::load_full_into_module(*model, tmp / "a/checkpoints/step-00000006");
  const at::Tensor idx = at::arange(2 * 16, at::kLong).remainder(cfg.vocab()).reshape({2, 16});
  flatshard_test::write_bytes(tmp / "idx.bin",
                              std::string(static_cast<const char*>(idx.data_ptr()), idx.nbytes()));
  at::Tensor mine;
  {
    at::NoGradGuard no_grad;
    mine = cfg.logits(*model, idx);  // the family's typed accessor: no cast to LlamaImpl
  }
  const std::string cmd = std::string(FLATSHARD_PYTHON_EXE) + " -W ignore " + FLATSHARD_SOURCE_DIR +
                          "/tests/hf_reference.py --logits " + tmp / "exported" + " " +
                          tmp / "idx.bin" + " " + tmp / "logits.bin" + " > " + tmp / "logits.log" +
                          " 2>&1";
  INFO(flatshard_test::slurp(tmp / "logits.log"));
  REQUIRE(std::system(cmd.c_str()) == 0);
  const at::Tensor want = read_raw(tmp / "logits.bin", {2, 16, cfg.vocab()}, at::kFloat);
  CHECK((mine - want).abs().max().item<double>() < 1e-4);
}

// --device cuda: one process per GPU (cli/launch.h, cli/cuda_rank.h). This machine class has no
// GPU (CUDA_VISIBLE_DEVICES is emptied so a GPU host answers the same): what is checked is each
// usage error, one line with exit 2, before any file is read; tools/gpu_check.sh's train_cli
// step runs it on a GPU.
TEST_CASE("flatshard-train --device cuda: ranks from the launcher or --nproc, clear errors",
          "[train]") {
  TempDir tmp;
  const std::vector<std::string> base = {"--data", tmp / "none.bin", "--out", tmp / "o"};
  auto usage = [&](std::vector<std::string> extra, std::vector<std::string> env,
                   const std::vector<std::string>& parts) {
    std::vector<std::string> args = base;
    args.insert(args.end(), extra.begin(), extra.end());
    flatshard_test::ToolRunOptions o = within(60);
    o.env = std::move(env);
    o.env.push_back("CUDA_VISIBLE_DEVICES=");
    const ToolRun r = run_tool(tmp.path(), kExe, args, o);
    INFO(r.out << r.err);
    CHECK(r.exit_code == 2);
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
    CHECK(r.err.rfind("flatshard-train: error: ", 0) == 0);
    bool any = false;
    for (const auto& p : parts) any = any || r.err.find(p) != std::string::npos;
    CHECK(any);
    CHECK_FALSE(flatshard::path_exists(tmp / "o"));  // nothing written
  };
  usage({"--device", "cuda", "--nproc", "2", "--world", "2"}, {},
        {"--nproc 2 with --world 2: --world counts CPU threads"});
  usage({"--nproc", "2"}, {}, {"--nproc 2 launches one process per GPU: it needs --device cuda"});
  usage({"--device", "cuda", "--world", "3"}, {}, {"--world 3 counts CPU threads"});
  // A malformed launcher variable: the parser's message (collectives/launch_env.h) names it.
  usage({"--device", "cuda"}, {"RANK=-1", "WORLD_SIZE=2", "LOCAL_RANK=0"}, {"RANK", "-1"});
  usage({"--device", "cuda"}, {"RANK=0", "WORLD_SIZE=junk", "LOCAL_RANK=0"}, {"WORLD_SIZE"});
  // No GPU: said plainly, under a launcher (this rank's GPU) or not (what to launch on); a build
  // without CUDA says that instead.
  usage({"--device", "cuda"}, {}, {"--device cuda: no CUDA device is visible", "has no CUDA"});
  usage({"--device", "cuda", "--nproc", "2"}, {},
        {"--device cuda: no CUDA device is visible", "has no CUDA"});
  usage({"--device", "cuda"}, {"RANK=0", "WORLD_SIZE=1", "LOCAL_RANK=0"},
        {"local rank 0 has no GPU: 0 visible", "has no CUDA"});
  // The help names both.
  {
    const ToolRun r = run_tool(tmp.path(), kExe, {"--help"});
    CHECK(r.exit_code == 0);
    CHECK(r.out.find("--device") != std::string::npos);
    CHECK(r.out.find("--nproc") != std::string::npos);
  }
}

// The model and sharding flags are cli/options.h's (the names, help and checks of bench and
// explain; config-file keys are the same names); MFU with --peak-tflops, as the bench computes
// it (cli::mfu: tokens/s per rank x the model's flops_per_token / peak FLOP/s).
TEST_CASE("flatshard-train: the shared model and sharding flags, MFU with --peak-tflops",
          "[train]") {
  TempDir tmp;
  const std::string data = tmp / "data";
  prepare(tmp.path(), data);
  {
    const ToolRun r = run_tool(tmp.path(), kExe, {"--help"});
    REQUIRE(r.exit_code == 0);
    for (const char* part : {"model family (models/family.h; default llama)", "--strategy",
                             "--reduce-dtype", "--prefetch", "--offload-step",
                             "--keep-low-precision-grads", "--keep-compute-shard",
                             "--peak-tflops"})
      CHECK(r.out.find(part) != std::string::npos);
  }
  // The shared flags on the command line, and a peak: every step's metrics line has "mfu".
  auto f = flags(data, tmp / "o1", 1, 3);
  for (const char* a : {"--strategy", "grad_op", "--prefetch", "2", "--reduce-dtype", "fp32",
                        "--peak-tflops", "0.001"})
    f.push_back(a);
  {
    const ToolRun r = run_tool(tmp.path(), kExe, f, within(120));
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(r.out.find("tok/s/rank | mfu ") != std::string::npos);
    auto cfg = flatshard::models::ModelConfig::preset("llama", "tiny");
    cfg.d_model() = 32;
    cfg.n_heads() = 2;
    cfg.seq_len() = 32;
    cfg.vocab() = 256;
    int steps = 0;
    std::istringstream in(flatshard_test::slurp(tmp / "o1/metrics.jsonl"));
    std::string line;
    while (std::getline(in, line)) {
      const auto j = flatshard::json::parse(line);
      if (!j.contains("loss")) continue;
      ++steps;
      REQUIRE(j.contains("mfu"));
      const double want = j["tokens_per_s_per_rank"].get<double>() * cfg.flops_per_token() / 1e9;
      CHECK(j["mfu"].get<double>() == Approx(want).epsilon(1e-9));
    }
    CHECK(steps == 3);
  }
  // The same flags from a config file (keys = flag names), bf16 parameters, no peak on cpu:
  // no "mfu".
  flatshard_test::write_bytes(tmp / "run.toml",
                              "param-dtype = \"bf16\"\nreduce-dtype = \"fp32\"\nprefetch = 2\n"
                              "strategy = \"grad_op\"\nmodel = \"llama\"\npreset = \"tiny\"\n");
  {
    auto g = flags(data, tmp / "o2", 1, 3);
    g.push_back("--config");
    g.push_back(tmp / "run.toml");
    const ToolRun r = run_tool(tmp.path(), kExe, g, within(120));
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(r.out.find("mfu") == std::string::npos);
    CHECK(flatshard_test::slurp(tmp / "o2/metrics.jsonl").find("mfu") == std::string::npos);
  }
  // Usage errors: one line, exit 2, before anything runs.
  auto usage = [&](std::vector<std::string> extra, const std::string& part) {
    auto args = flags(data, tmp / "o3", 1, 3);
    args.insert(args.end(), extra.begin(), extra.end());
    const ToolRun r = run_tool(tmp.path(), kExe, args, within(60));
    INFO(r.out << r.err);
    CHECK(r.exit_code == 2);
    CHECK(r.err.find(part) != std::string::npos);
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
    CHECK_FALSE(flatshard::path_exists(tmp / "o3"));
  };
  usage({"--peak-tflops", "0"}, "--peak-tflops must be > 0, got 0");
  usage({"--param-dtype", "fp16"}, "--param-dtype fp16 needs a gradient scaler");
  usage({"--offload", "1", "--offload-step", "backward"},
        "--offload-step backward steps units through flatshard::FusedAdamW: add --optimizer fused");
  usage({"--layers", "0"}, "--layers");
  usage({"--strategy", "zero3"}, "--strategy");
}

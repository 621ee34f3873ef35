// data/token_dataset.h: batches against closed forms (files whose token at position p is a known
// function of p), determinism from (seed, step), rank slices that union to the world-1 batch, and
// every untrusted-input error (one line, naming the file and the value).
#include <catch2/catch.hpp>

#include <c10/util/Exception.h>
#include <sys/stat.h>

#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "data/token_dataset.h"
#include "temp_dir.h"

using flatshard::data::BatchLayout;
using flatshard::data::TokenDataset;
using flatshard::data::TokenDatasetOptions;
using flatshard::data::TokenDtype;
using flatshard_test::TempDir;
using flatshard_test::write_bytes;

namespace {

// Tokens f(p) = (p * 7 + offset) % vocab, little-endian, `width` bytes each.
std::string token_bytes(int64_t n, int width, int64_t vocab, int64_t offset = 0) {
  std::string out;
  for (int64_t p = 0; p < n; ++p) {
    const uint32_t t = static_cast<uint32_t>((p * 7 + offset) % vocab);
    char b[4];
    std::memcpy(b, &t, 4);
    out.append(b, static_cast<size_t>(width));
  }
  return out;
}

std::string llmc_header(int32_t version, int32_t count) {
  std::string h(flatshard::data::kLlmcHeaderBytes, '\0');
  const int32_t magic = flatshard::data::kLlmcMagic;
  std::memcpy(h.data(), &magic, 4);
  std::memcpy(h.data() + 4, &version, 4);
  std::memcpy(h.data() + 8, &count, 4);
  return h;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("token files: windows hold consecutive tokens of one file", "[data]") {
  TempDir dir;
  const int64_t vocab = 1000;
  for (int width : {2, 4}) {
    const std::string path = dir / ("t" + std::to_string(width) + ".bin");
    write_bytes(path, token_bytes(100, width, vocab));
    TokenDataset ds(path, {width == 2 ? TokenDtype::kUint16 : TokenDtype::kUint32, vocab, 8});
    CHECK(ds.num_tokens() == 100);
    CHECK(ds.num_windows() == 100 - 9 + 1);
    for (int64_t w : {int64_t{0}, int64_t{17}, ds.num_windows() - 1}) {
      at::Tensor t = ds.window(w);
      REQUIRE(t.numel() == 9);
      for (int64_t i = 0; i < 9; ++i) CHECK(t[i].item<int64_t>() == ((w + i) * 7) % vocab);
    }
  }
}

TEST_CASE("token files: a directory of shards and llm.c's header", "[data]") {
  TempDir dir;
  const int64_t vocab = 500;
  // Shard 0: raw uint16, 20 tokens; shard 1: llm.c version 2 (uint32), 30 tokens offset 3;
  // "notes.txt" is ignored.
  write_bytes(dir / "a_000.bin", token_bytes(20, 2, vocab));
  write_bytes(dir / "a_001.bin", llmc_header(2, 30) + token_bytes(30, 4, vocab, 3));
  write_bytes(dir / "notes.txt", "not tokens");
  TokenDataset ds(dir.path(), {TokenDtype::kUint16, vocab, 4});
  REQUIRE(ds.files().size() == 2);
  CHECK(ds.num_tokens() == 50);
  CHECK(ds.num_windows() == (20 - 4) + (30 - 4));
  // The first window of shard 1 comes right after shard 0's last.
  at::Tensor t = ds.window(16);
  for (int64_t i = 0; i < 5; ++i) CHECK(t[i].item<int64_t>() == (i * 7 + 3) % vocab);
  at::Tensor last0 = ds.window(15);
  CHECK(last0[4].item<int64_t>() == (19 * 7) % vocab);
}

TEST_CASE("token batches: deterministic, shifted by one, sliced per rank", "[data]") {
  TempDir dir;
  const int64_t vocab = 1 << 16;
  write_bytes(dir / "t.bin", token_bytes(5000, 2, vocab));
  TokenDataset ds(dir / "t.bin", {TokenDtype::kUint16, vocab, 16});
  const BatchLayout one{8, 4, 1, 0};
  REQUIRE(one.accumulation() == 2);
  auto a = ds.micro_batch(42, 3, one, 1);
  auto b = ds.micro_batch(42, 3, one, 1);
  CHECK(at::equal(a.first, b.first));
  CHECK(a.first.sizes() == at::IntArrayRef({4, 16}));
  CHECK(at::equal(a.first.narrow(1, 1, 15), a.second.narrow(1, 0, 15)));
  CHECK_FALSE(at::equal(ds.micro_batch(42, 4, one, 1).first, a.first));
  CHECK_FALSE(at::equal(ds.micro_batch(43, 3, one, 1).first, a.first));

  // World 2 x 2 micro-batches of 2: the same 8 samples as world 1, each once.
  std::multiset<std::vector<int64_t>> whole, split;
  auto add = [](std::multiset<std::vector<int64_t>>& s, const at::Tensor& x) {
    for (int64_t r = 0; r < x.size(0); ++r) {
      at::Tensor row = x[r].contiguous();
      s.insert(std::vector<int64_t>(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + 16));
    }
  };
  for (int64_t m = 0; m < 2; ++m) add(whole, ds.micro_batch(7, 5, one, m).first);
  for (int rank = 0; rank < 2; ++rank) {
    const BatchLayout l{8, 2, 2, rank};
    REQUIRE(l.accumulation() == 2);
    for (int64_t m = 0; m < 2; ++m) add(split, ds.micro_batch(7, 5, l, m).first);
  }
  CHECK(whole == split);
  // The sample rule is the documented one.
  CHECK(ds.micro_batch(7, 5, one, 0).first[1][0].item<int64_t>() ==
        (ds.sample_window(7, 5, 1) * 7) % vocab);

  CHECK(error_of([&] {
          BatchLayout{6, 4, 1, 0}.check();
        }).find("global batch 6") != std::string::npos);
}

TEST_CASE("token files: untrusted input is a one-line error naming the file and value", "[data]") {
  TempDir dir;
  auto open = [&](const std::string& name, int64_t vocab = 1000, int64_t seq = 8,
                  TokenDtype d = TokenDtype::kUint16) {
    return error_of([&] {
      TokenDataset ds(dir / name, {d, vocab, seq});
      for (int64_t w = 0; w < ds.num_windows(); ++w) ds.window(w);
    });
  };
  auto has = [](const std::string& msg, const std::string& part) {
    INFO(msg);
    CHECK(msg.find(part) != std::string::npos);
    CHECK(msg.find('\n') == std::string::npos);
  };
  write_bytes(dir / "odd.bin", token_bytes(50, 2, 1000) + "x");
  has(open("odd.bin"), "odd.bin': 101 bytes, not a multiple of 2");
  write_bytes(dir / "odd4.bin", token_bytes(50, 2, 1000) + "xy");
  has(open("odd4.bin", 1000, 8, TokenDtype::kUint32), "102 bytes, not a multiple of 4");
  write_bytes(dir / "empty.bin", "");
  has(open("empty.bin"), "empty.bin': empty");
  write_bytes(dir / "short.bin", token_bytes(8, 2, 1000));
  has(open("short.bin"), "8 tokens, fewer than sequence length 8 + 1 = 9");
  // Token 3 is 3 * 7 = 21 with vocab 1000; with vocab 20 token index 3 is the first >= 20.
  write_bytes(dir / "big.bin", token_bytes(40, 2, 1000));
  has(open("big.bin", 20), "big.bin': token 3 is 21, not below the model's vocabulary size 20");
  write_bytes(dir / "trunc.bin", llmc_header(1, 100) + token_bytes(60, 2, 1000));
  has(open("trunc.bin"), "llm.c header says 100 tokens (1224 bytes), the file has 1144 bytes");
  write_bytes(dir / "ver.bin", llmc_header(7, 10) + token_bytes(10, 2, 1000));
  has(open("ver.bin"), "llm.c header version 7");
  REQUIRE(::mkfifo((dir / "fifo.bin").c_str(), 0600) == 0);
  has(open("fifo.bin"), "fifo.bin': is a FIFO, not a regular file");
  has(open("missing.bin"), "missing.bin': cannot open");
  ::mkdir((dir / "nobin").c_str(), 0700);
  has(open("nobin"), "a directory without any *.bin token file");
  write_bytes(dir / "esc\x1b.bin", "");
  has(open("esc\x1b.bin"), "esc\\x1b.bin");
}

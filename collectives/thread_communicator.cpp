#include "collectives/thread_communicator.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <condition_variable>
#include <exception>
#include <mutex>
#include <sstream>
#include <thread>

namespace flatshard {

namespace {

enum class Kind { kAllGather, kReduceScatter, kAllReduce, kBroadcast, kBarrier };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kAllGather:
      return "all_gather";
    case Kind::kReduceScatter:
      return "reduce_scatter";
    case Kind::kAllReduce:
      return "all_reduce";
    case Kind::kBroadcast:
      return "broadcast";
    case Kind::kBarrier:
      return "barrier";
  }
  return "?";
}

// What one rank contributes to a collective.
struct Post {
  Kind kind = Kind::kBarrier;
  at::ScalarType dtype = at::kFloat;
  int64_t numel = 0;  // input elements
  int64_t extra = 0;  // reduce op or broadcast root
  at::Tensor input;
};

std::string describe(const Post& p) {
  std::ostringstream os;
  os << kind_name(p.kind);
  if (p.kind != Kind::kBarrier) os << "(dtype=" << p.dtype << ", input numel=" << p.numel;
  if (p.kind == Kind::kReduceScatter || p.kind == Kind::kAllReduce)
    os << ", op=" << to_string(static_cast<ReduceOp>(p.extra));
  if (p.kind == Kind::kBroadcast) os << ", root=" << p.extra;
  if (p.kind != Kind::kBarrier) os << ")";
  return os.str();
}

}  // namespace

struct ThreadWorld::Impl {
  int world = 1;
  std::chrono::milliseconds timeout{60000};

  std::mutex mu;
  std::condition_variable cv;
  std::vector<Post> posts;        // per rank, valid while a collective is in its arrive phase
  std::vector<int64_t> seq;       // per rank: number of collectives entered
  int arrived = 0;
  int64_t generation = 0;         // bumped each time all ranks reach a barrier point
  std::string aborted;            // non-empty once aborted

  // Waits until all ranks reach this point. Returns normally or throws on abort / timeout.
  void sync_point(std::unique_lock<std::mutex>& lock, int rank, const char* what, int64_t op_seq) {
    const int64_t my_gen = generation;
    if (++arrived == world) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (generation == my_gen && aborted.empty()) {
      if (cv.wait_until(lock, deadline) == std::cv_status::timeout && generation == my_gen &&
          aborted.empty()) {
        std::ostringstream os;
        os << "flatshard threads backend: rank " << rank << " timed out after "
           << timeout.count() << " ms in collective #" << op_seq << " (" << what
           << "); ranks that have not reached it:";
        for (int r = 0; r < world; ++r)
          if (seq[r] <= op_seq) os << " " << r;
        aborted = os.str();
        cv.notify_all();
        TORCH_CHECK(false, aborted);
      }
    }
    // Completed before (or while) another rank aborted: this collective's result is valid;
    // the abort surfaces at this rank's next collective.
    if (generation != my_gen) return;
    TORCH_CHECK(false, "flatshard threads backend: rank ", rank, " in collective #", op_seq, " (",
                what, ") aborted: ", aborted);
  }
};

// ---------------------------------------------------------------------------------------------
ThreadWorld::ThreadWorld(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ThreadWorld::~ThreadWorld() = default;

std::shared_ptr<ThreadWorld> ThreadWorld::create(int world_size, std::chrono::milliseconds timeout) {
  TORCH_CHECK(world_size >= 1, "ThreadWorld: world_size must be >= 1, got ", world_size);
  TORCH_CHECK(timeout.count() > 0, "ThreadWorld: timeout must be positive, got ", timeout.count(),
              " ms");
  auto impl = std::make_unique<Impl>();
  impl->world = world_size;
  impl->timeout = timeout;
  impl->posts.resize(world_size);
  impl->seq.assign(world_size, 0);
  return std::shared_ptr<ThreadWorld>(new ThreadWorld(std::move(impl)));
}

int ThreadWorld::world_size() const { return impl_->world; }
std::chrono::milliseconds ThreadWorld::timeout() const { return impl_->timeout; }

std::unique_ptr<ThreadCommunicator> ThreadWorld::communicator(int rank) {
  TORCH_CHECK(rank >= 0 && rank < impl_->world, "ThreadWorld: rank ", rank,
              " out of range for world_size ", impl_->world);
  return std::make_unique<ThreadCommunicator>(shared_from_this(), rank);
}

void ThreadWorld::abort(const std::string& reason) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->aborted.empty()) impl_->aborted = reason;
  impl_->cv.notify_all();
}

// ---------------------------------------------------------------------------------------------
namespace {

// Runs one collective for `rank`: post, check agreement, compute into a private result from the
// other ranks' inputs, wait until everyone has read, then `finish` writes the rank's output.
// Note [Two sync points]: the first makes every input visible; the second guarantees no rank
// writes its output (which may alias its input, in-place collectives) while another still reads.
template <class Compute, class Finish>
void run_collective(ThreadWorld::Impl& w, int rank, Post post, Compute compute, Finish finish) {
  std::unique_lock<std::mutex> lock(w.mu);
  TORCH_CHECK(w.aborted.empty(), "flatshard threads backend: rank ", rank, " cannot start ",
              describe(post), ": the world was aborted: ", w.aborted);
  const int64_t op_seq = w.seq[rank]++;
  const std::string what = describe(post);
  w.posts[rank] = std::move(post);
  w.sync_point(lock, rank, what.c_str(), op_seq);
  // Every rank checks agreement with rank 0 and throws the same message.
  const Post& p0 = w.posts[0];
  for (int r = 1; r < w.world; ++r) {
    const Post& pr = w.posts[r];
    if (pr.kind != p0.kind || pr.dtype != p0.dtype || pr.numel != p0.numel || pr.extra != p0.extra) {
      std::ostringstream os;
      os << "flatshard threads backend: ranks disagree in collective #" << op_seq << ": rank 0 called "
         << describe(p0) << " but rank " << r << " called " << describe(pr)
         << ". Every rank must issue the same collectives in the same order: check that all "
            "ranks run the same model, plan and options and call the same units in the same "
            "order (FLATSHARD_DEBUG=1 names the units)";
      lock.unlock();
      TORCH_CHECK(false, os.str(), " (reported by rank ", rank, ")");
    }
  }
  std::vector<at::Tensor> inputs(w.world);
  for (int r = 0; r < w.world; ++r) inputs[r] = w.posts[r].input;
  lock.unlock();
  at::Tensor result = compute(inputs);
  // Drop our references to the other ranks' inputs before they may leave the collective, so
  // every rank releases its own tensors (a last reference dropped on another thread would
  // free that rank's tensor here, racing with its owner's use of the allocator's state).
  inputs.clear();
  lock.lock();
  w.sync_point(lock, rank, what.c_str(), op_seq);
  w.posts[rank].input = at::Tensor();
  lock.unlock();
  finish(result);
}

at::Tensor reduce(const std::vector<at::Tensor>& parts, ReduceOp op) {
  // Accumulate in fp32 in rank order so every rank computes bit-identical results.
  at::Tensor acc = parts[0].to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  for (size_t r = 1; r < parts.size(); ++r) {
    if (op == ReduceOp::kMax) {
      at::maximum_out(acc, acc, parts[r].to(at::kFloat));  // NaN propagates
    } else {
      acc.add_(parts[r].to(at::kFloat));
    }
  }
  if (op == ReduceOp::kAvg) acc.div_(static_cast<double>(parts.size()));
  return acc;
}

}  // namespace

ThreadCommunicator::ThreadCommunicator(std::shared_ptr<ThreadWorld> world, int rank)
    : world_(std::move(world)), rank_(rank) {}

int ThreadCommunicator::world_size() const { return world_->world_size(); }
std::chrono::milliseconds ThreadCommunicator::timeout() const { return world_->timeout(); }

void ThreadCommunicator::all_gather(const at::Tensor& input, const at::Tensor& output,
                                    c10::Stream) {
  const int world = world_size();
  detail::check_all_gather("all_gather", rank_, world, input, output, device());
  ++counters_.all_gathers;
  counters_.bytes += input.nbytes();
  Post post{Kind::kAllGather, input.scalar_type(), input.numel(), 0, input};
  const int64_t n = input.numel();
  run_collective(
      world_->impl(), rank_, std::move(post),
      [&](const std::vector<at::Tensor>& in) {
        std::vector<at::Tensor> flat;
        flat.reserve(in.size());
        for (auto& t : in) flat.push_back(t.reshape({-1}));
        return n == 0 ? at::Tensor() : at::cat(flat);
      },
      [&](const at::Tensor& r) {
        if (n > 0) output.view({-1}).copy_(r);
      });
}

void ThreadCommunicator::reduce_scatter(const at::Tensor& input, const at::Tensor& output,
                                        ReduceOp op, c10::Stream) {
  const int world = world_size();
  detail::check_reduce_scatter("reduce_scatter", rank_, world, input, output, device());
  ++counters_.reduce_scatters;
  counters_.bytes += input.nbytes();
  const int64_t n = output.numel();
  const int me = rank_;
  Post post{Kind::kReduceScatter, input.scalar_type(), input.numel(), static_cast<int64_t>(op),
            input};
  run_collective(
      world_->impl(), rank_, std::move(post),
      [&](const std::vector<at::Tensor>& in) {
        if (n == 0) return at::Tensor();
        std::vector<at::Tensor> parts;
        for (auto& t : in) parts.push_back(t.reshape({-1}).narrow(0, me * n, n));
        return reduce(parts, op);
      },
      [&](const at::Tensor& r) {
        if (n > 0) output.view({-1}).copy_(r);
      });
}

void ThreadCommunicator::all_reduce(const at::Tensor& tensor, ReduceOp op, c10::Stream, Lane) {
  detail::check_tensor("all_reduce", rank_, "tensor", tensor, device());
  ++counters_.all_reduces;
  counters_.bytes += tensor.nbytes();
  Post post{Kind::kAllReduce, tensor.scalar_type(), tensor.numel(), static_cast<int64_t>(op),
            tensor};
  run_collective(
      world_->impl(), rank_, std::move(post),
      [&](const std::vector<at::Tensor>& in) {
        return tensor.numel() == 0 ? at::Tensor() : reduce(in, op);
      },
      [&](const at::Tensor& r) {
        if (tensor.numel() > 0) tensor.copy_(r.view(tensor.sizes()));
      });
}

void ThreadCommunicator::broadcast(const at::Tensor& tensor, int root, c10::Stream) {
  detail::check_tensor("broadcast", rank_, "tensor", tensor, device());
  TORCH_CHECK(root >= 0 && root < world_size(), "broadcast (rank ", rank_, "): root ", root,
              " out of range for world_size ", world_size());
  ++counters_.broadcasts;
  counters_.bytes += tensor.nbytes();
  Post post{Kind::kBroadcast, tensor.scalar_type(), tensor.numel(), root, tensor};
  run_collective(
      world_->impl(), rank_, std::move(post),
      [&](const std::vector<at::Tensor>& in) {
        return (rank_ == root || tensor.numel() == 0) ? at::Tensor() : in[root].clone();
      },
      [&](const at::Tensor& r) {
        if (r.defined()) tensor.copy_(r);
      });
}

void ThreadCommunicator::barrier() {
  run_collective(
      world_->impl(), rank_, Post{},
      [](const std::vector<at::Tensor>&) { return at::Tensor(); }, [](const at::Tensor&) {});
}

// ---------------------------------------------------------------------------------------------
void run_ranks(int world_size, const std::function<void(Communicator&)>& fn,
               std::chrono::milliseconds timeout) {
  auto world = ThreadWorld::create(world_size, timeout);
  std::vector<std::exception_ptr> errors(world_size);
  std::vector<std::thread> threads;
  threads.reserve(world_size);
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      try {
        at::set_num_threads(1);
        auto comm = world->communicator(r);
        fn(*comm);
      } catch (const std::exception& e) {
        errors[r] = std::current_exception();
        world->abort(std::string("rank ") + std::to_string(r) + " failed: " + e.what());
      } catch (...) {
        errors[r] = std::current_exception();
        world->abort("rank " + std::to_string(r) + " failed with a non-standard exception");
      }
    });
  }
  for (auto& t : threads) t.join();
  // Report the root cause: the lowest rank whose error is not a consequence of another rank's
  // abort; if every error is secondary (e.g. a timeout), the lowest rank's.
  int first = -1;
  std::string first_msg;
  for (int r = 0; r < world_size; ++r) {
    if (!errors[r]) continue;
    std::string msg;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const c10::Error& e) {
      msg = e.what_without_backtrace();
    } catch (const std::exception& e) {
      msg = e.what();
    } catch (...) {
      msg = "non-standard exception";
    }
    const bool secondary = msg.find("aborted") != std::string::npos;
    if (first < 0 || (!secondary && first_msg.find("aborted") != std::string::npos)) {
      first = r;
      first_msg = msg;
    }
  }
  if (first >= 0) TORCH_CHECK(false, "rank ", first, ": ", first_msg);
}

}  // namespace flatshard

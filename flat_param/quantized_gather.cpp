#include "flat_param/quantized_gather.h"

#include <c10/core/Event.h>
#include <c10/util/Exception.h>

#include <cfloat>
#include <cmath>
#include <limits>
#include <optional>
#include <sstream>
#include <utility>
#include <vector>

#include "collectives/communicator.h"
#include "flat_param/collective_plan.h"
#include "flat_param/upcast.h"  // kernel_dtype

#if FLATSHARD_WITH_CUDA_KERNELS
#include <c10/cuda/CUDAStream.h>

#include "flat_param/quantize_kernel.h"
#endif

namespace flatshard {

at::Tensor scales_from_amax(const at::Tensor& amax, double qmax) {
  // Divided by a tensor, not a Scalar: ATen's CUDA division by a CPU scalar multiplies by its
  // reciprocal (one ulp off at times), its CPU one divides; a tensor divides on both, as the
  // Python reference and the CUDA kernels (quantize_kernel.h) do.
  const at::Tensor s =
      at::clamp_min(amax / at::full({}, qmax, amax.options()), static_cast<double>(FLT_MIN));
  return at::where(amax == 0, at::ones_like(s), s);
}

at::Tensor fp8_quantize(const at::Tensor& x, const at::Tensor& s) {
  return at::clamp(x / s, -kFp8Max, kFp8Max).to(at::kFloat8_e4m3fn);
}

at::Tensor fp8_dequantize(const at::Tensor& q, const at::Tensor& s, at::ScalarType dtype) {
  return (q.to(at::kFloat) * s).to(dtype);
}

int64_t int8_num_blocks(int64_t n) { return (n + kInt8BlockSize - 1) / kInt8BlockSize; }

namespace {

// `x` zero-padded to whole blocks, as [blocks, kInt8BlockSize] fp32.
at::Tensor as_blocks(const at::Tensor& x) {
  const int64_t n = x.numel(), nb = int8_num_blocks(n);
  at::Tensor padded = at::zeros({nb * kInt8BlockSize}, x.options().dtype(at::kFloat));
  padded.narrow(0, 0, n).copy_(x.reshape({-1}));
  return padded.view({nb, kInt8BlockSize});
}

}  // namespace

at::Tensor int8_block_scales(const at::Tensor& x) {
  at::Tensor blocks = as_blocks(x);
  if (blocks.size(0) == 0) return at::empty({0}, blocks.options());
  return scales_from_amax(blocks.abs().amax(1), kInt8Max);
}

at::Tensor int8_quantize(const at::Tensor& x, const at::Tensor& scales) {
  const int64_t n = x.numel();
  at::Tensor q = at::clamp(at::round(as_blocks(x) / scales.unsqueeze(1)), -kInt8Max, kInt8Max);
  return q.to(at::kChar).view({-1}).narrow(0, 0, n);
}

at::Tensor int8_dequantize(const at::Tensor& q, const at::Tensor& scales, at::ScalarType dtype) {
  const int64_t n = q.numel();
  return (as_blocks(q) * scales.unsqueeze(1)).view({-1}).narrow(0, 0, n).to(dtype);
}

namespace {

int64_t round_up4(int64_t n) { return (n + 3) / 4 * 4; }

// Per rank, the int8 wire: [scales | data | pad to 4 B].
int64_t int8_wire_bytes(int64_t shard_numel) {
  return 4 * int8_num_blocks(shard_numel) + round_up4(shard_numel);
}

// Per rank, the delayed fp8 wire: [amax per parameter | fp8 data | pad to 4 B].
int64_t fp8_delayed_wire_bytes(const FlatLayout& layout) {
  return 4 * static_cast<int64_t>(layout.numels.size()) + round_up4(layout.shard_numel);
}

// Note [Quantize kernels]: the dtype the CUDA kernels (quantize_kernel.h) write full() in, when
// the plan takes them: a CUDA master, contiguous buffers, fp32 / bf16 / fp16 full(). nullopt:
// ATen's ops (the CPU path, and the reference the kernels are held to bit for bit by
// tests/gpu_quantized_gather_test.cpp and tests/quantize_kernel_check.py).
std::optional<kernels::KernelDtype> wire_kernel_dtype(const GatherArgs& a) {
#if FLATSHARD_WITH_CUDA_KERNELS
  if (a.master.is_cuda() && a.master.is_contiguous() && a.full.is_contiguous())
    return kernel_dtype(a.full.scalar_type());
#else
  (void)a;
#endif
  return std::nullopt;
}

#if FLATSHARD_WITH_CUDA_KERNELS
cudaStream_t cuda_stream(c10::Stream s) { return c10::cuda::CUDAStream(s).stream(); }
#endif

// What both quantized gathers share: the shard's place in the layout and the names for errors.
class QuantizedGather : public GatherPlan, private GatherCheck {
 public:
  QuantizedGather(std::string name, std::string unit, GatherArgs args, const FlatLayout& layout,
                  at::ScalarType param_dtype, Communicator& comm)
      : GatherPlan(std::move(name), std::move(args)),
        unit_(std::move(unit)),
        layout_(layout),
        param_dtype_(param_dtype),
        comm_(comm),
        rank_(comm.rank()),
        world_(comm.world_size()),
        kernel_(wire_kernel_dtype(args_)),
        deferred_(args_.master.device().type() != c10::DeviceType::CPU) {
    if (deferred_) extras_.check = this;
  }

 protected:
  // Non-finite masters (the header's Contract). `values` (fp32, any shape, the same on every
  // rank: gathered or all-reduced) must be finite; else report() throws with the flat index of
  // the first non-finite one and how many there are. On the CPU at once; on a device Note
  // [Deferred gather check]: recorded on `stream`, thrown by verify().
  void check_finite(const at::Tensor& values, c10::Stream stream) {
    const at::Tensor flat = values.reshape({-1});
    if (!deferred_) {
      if (at::isfinite(flat).all().item<bool>()) return;
      const at::Tensor bad = at::nonzero(at::logical_not(at::isfinite(flat))).to(at::kCPU);
      report(bad[0][0].item<int64_t>(), bad.size(0));
    }
    record_nonfinite(flat, stream);
  }
  // Throws the error for the first non-finite value `first` (flat index into check_finite's
  // values) of `count`.
  [[noreturn]] virtual void report(int64_t first, int64_t count) const = 0;

#if FLATSHARD_WITH_CUDA_KERNELS
  void check_launch(cudaError_t e, const char* what) const {
    TORCH_CHECK(e == cudaSuccess, "unit '", unit_, "' (rank ", rank_, "): the ", what,
                " kernel launch failed on ", args_.master.device(), ": ", cudaGetErrorString(e));
  }
#endif
  std::string param_name(size_t i) const {
    if (i < args_.names.size()) return "'" + args_.names[i] + "'";
    return "#" + std::to_string(i);
  }
  // The parameters (names) that overlap the flat range [b, e).
  std::string params_in(int64_t b, int64_t e) const {
    std::string out;
    for (size_t i = 0; i < layout_.numels.size(); ++i) {
      const int64_t pb = layout_.offsets[i], pe = pb + layout_.numels[i];
      if (pb < e && b < pe) out += (out.empty() ? "" : ", ") + param_name(i);
    }
    return out.empty() ? "padding only" : out;
  }

  std::string unit_;
  FlatLayout layout_;
  at::ScalarType param_dtype_;
  Communicator& comm_;
  int rank_, world_;
  // Note [Quantize kernels]: set when quantize_kernel.h's kernels write and read the wire.
  std::optional<kernels::KernelDtype> kernel_;

 private:
  static constexpr int64_t kNone = std::numeric_limits<int64_t>::max();  // no non-finite value

  // On the gather's stream, no host wait: the first non-finite value's index and the count
  // go into found_ (the first gather that saw one keeps it), and found_ into pinned host
  // memory, with an event after the copy for verify().
  void record_nonfinite(const at::Tensor& flat, c10::Stream stream) {
    if (!found_.defined() || reset_) {
      if (!found_.defined()) {
        found_ = at::empty({2}, flat.options().dtype(at::kLong));
        host_ = at::empty({2}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
        event_.emplace(flat.device().type());
      }
      found_.select(0, 0).fill_(kNone);
      found_.select(0, 1).zero_();
      reset_ = false;
    }
    if (!index_.defined() || index_.numel() != flat.numel())
      index_ = at::arange(flat.numel(), flat.options().dtype(at::kLong));
    const at::Tensor bad = at::logical_not(at::isfinite(flat));
    const at::Tensor now = at::stack({at::where(bad, index_, kNone).amin(), bad.sum()});
    found_.copy_(at::where(found_.select(0, 0) == kNone, now, found_));
    host_.copy_(found_, /*non_blocking=*/true);
    event_->record(stream);
    recorded_ = true;
  }

  // GatherCheck: Note [Deferred gather check].
  void verify() override {
    if (!recorded_) return;
    event_->synchronize();  // the last gather's copy into host_ is done
    recorded_ = false;
    const int64_t first = host_.data_ptr<int64_t>()[0], count = host_.data_ptr<int64_t>()[1];
    if (first == kNone) return;
    reset_ = true;  // the next gather starts afresh (found_ is the gather stream's to write)
    report(first, count);
  }

  // Note [Deferred gather check]: true on a device (the check's host read would wait there).
  bool deferred_;
  at::Tensor found_;  // device int64 [2]: {first non-finite index or kNone, count}
  at::Tensor index_;  // device int64 arange over check_finite's values (cached)
  at::Tensor host_;   // pinned int64 [2]: found_ as of the last gather
  // Recorded on the gather stream after the copy into host_: verify() waits for it, not for
  // the whole device.
  std::optional<c10::Event> event_;
  bool recorded_ = false;  // a gather recorded since the last verify()
  bool reset_ = false;     // verify() reported: the next gather clears found_ first
};

// fp8: amax per original parameter (all-reduce max), fp8 bytes on the wire.
class Fp8AllGather final : public QuantizedGather {
 public:
  // `delayed`: Note [Delayed fp8 amax] (quantized_gather.h).
  Fp8AllGather(std::string unit, GatherArgs args, const FlatLayout& layout,
               at::ScalarType param_dtype, Communicator& comm, bool delayed)
      : QuantizedGather("Fp8AllGather", std::move(unit), std::move(args), layout, param_dtype,
                        comm),
        delayed_(delayed) {
    extras_.fp8_scales = &scales_;
    const int64_t sb = layout_.shard_begin(rank_), se = layout_.shard_end(rank_);
    int64_t at = 0;  // end of the last parameter: what lies between is padding
    for (size_t i = 0; i < layout_.numels.size(); ++i) {
      const int64_t pb = layout_.offsets[i], pe = pb + layout_.numels[i];
      if (pb > at) gaps_.emplace_back(at, pb - at);
      at = std::max(at, pe);
      const int64_t b = std::max(pb, sb), e = std::min(pe, se);
      if (b < e) local_.push_back({i, b - sb, e - b});
    }
    if (layout_.padded_numel > at) gaps_.emplace_back(at, layout_.padded_numel - at);
  }
  int64_t bytes() const override {
    return delayed_ ? fp8_delayed_wire_bytes(layout_)
                    : layout_.shard_numel + 4 * static_cast<int64_t>(layout_.numels.size());
  }
  void gather(c10::Stream stream) override {
    if (layout_.padded_numel == 0) return;
    if (delayed_) return gather_delayed(stream);
    const int64_t n = layout_.shard_numel;
    const auto fopt = args_.master.options().dtype(at::kFloat);
    at::Tensor amax = local_amax();
    comm_.all_reduce(amax, ReduceOp::kMax, stream, Lane::kAllGather);
    const at::Tensor scales = scales_from_amax(amax, kFp8Max);
    check_finite(amax, stream);
    scales_ = scales;
    at::Tensor wire = at::empty({world_ * n}, fopt.dtype(at::kByte));
    at::Tensor mine = wire.narrow(0, rank_ * n, n);
    mine.zero_();  // padding: fp8 0x00 is +0
    if (kernel_)
      quantize_kernels(mine, scales, stream);
    else
      quantize_aten(mine, scales);
    comm_.all_gather(mine, wire, stream);
    // The gathered wire is the whole flat buffer in fp8.
    if (kernel_)
      dequantize_kernels(wire, scales, stream);
    else
      dequantize_aten(wire, scales);
    for (const auto& [b, len] : gaps_) args_.full.narrow(0, b, len).zero_();
  }

 private:
  struct Local {
    size_t param;
    int64_t begin, numel;  // in the master shard
  };

  // amax per parameter over this rank's part of it (0 where it holds none); a non-finite one
  // as +inf, so every rank sees the same non-finite maximum (NCCL's max need not propagate
  // NaN).
  at::Tensor local_amax() const {
    at::Tensor amax = at::zeros({static_cast<int64_t>(layout_.numels.size())},
                                args_.master.options().dtype(at::kFloat));
    for (const Local& l : local_)
      amax.narrow(0, l.param, 1)
          .copy_(args_.master.narrow(0, l.begin, l.numel).abs().amax().view({1}));
    const double inf = std::numeric_limits<double>::infinity();
    return at::nan_to_num(amax, inf, inf, inf);
  }

  // Note [Delayed fp8 amax]: the scales are last gather's (the first gather all-reduces);
  // this rank's amax travels in front of its fp8 bytes and, maxed over the ranks, gives the
  // next gather's scales.
  void gather_delayed(c10::Stream stream) {
    const int64_t n = layout_.shard_numel, P = static_cast<int64_t>(layout_.numels.size());
    const int64_t w = fp8_delayed_wire_bytes(layout_);
    const at::Tensor amax = local_amax();
    if (!last_amax_.defined()) {  // the first gather: no earlier amax, the all-reduce
      last_amax_ = amax.clone();
      comm_.all_reduce(last_amax_, ReduceOp::kMax, stream, Lane::kAllGather);
    }
    const at::Tensor scales = scales_from_amax(last_amax_, kFp8Max);
    scales_ = scales;
    at::Tensor wire = at::empty({world_ * w}, args_.master.options().dtype(at::kByte));
    at::Tensor mine = wire.narrow(0, rank_ * w, w);
    mine.narrow(0, 0, 4 * P).view(at::kFloat).copy_(amax);
    at::Tensor data = mine.narrow(0, 4 * P, w - 4 * P);
    data.zero_();  // padding and the tail: fp8 0x00 is +0
    if (kernel_)
      quantize_kernels(data, scales, stream);
    else
      quantize_aten(data, scales);
    comm_.all_gather(mine, wire, stream);
    const at::Tensor per_rank = wire.view({world_, w});
    // The amax of the master as this gather sent it, the same on every rank.
    last_amax_ = per_rank.narrow(1, 0, 4 * P).view(at::kFloat).amax(0);
    check_finite(last_amax_, stream);
    // The ranks' fp8 parts, made one flat buffer (a copy: they sit between the amaxes).
    const at::Tensor flat8 = per_rank.narrow(1, 4 * P, n).contiguous().view({-1});
    if (kernel_)
      dequantize_kernels(flat8, scales, stream);
    else
      dequantize_aten(flat8, scales);
    for (const auto& [b, len] : gaps_) args_.full.narrow(0, b, len).zero_();
  }

  // This rank's parameters' parts into its slot `mine` of the wire, with their scales.
  void quantize_aten(const at::Tensor& mine, const at::Tensor& scales) const {
    const at::Tensor mine8 = mine.view(at::kFloat8_e4m3fn);
    for (const Local& l : local_)
      mine8.narrow(0, l.begin, l.numel)
          .copy_(
              fp8_quantize(args_.master.narrow(0, l.begin, l.numel), scales.narrow(0, l.param, 1)));
  }
  void dequantize_aten(const at::Tensor& wire, const at::Tensor& scales) const {
    const at::Tensor all8 = wire.view(at::kFloat8_e4m3fn);
    for (size_t i = 0; i < layout_.numels.size(); ++i) {
      const int64_t off = layout_.offsets[i], numel = layout_.numels[i];
      if (numel == 0) continue;
      args_.full.narrow(0, off, numel)
          .copy_(fp8_dequantize(all8.narrow(0, off, numel), scales.narrow(0, i, 1), param_dtype_));
    }
  }
  // The same with quantize_kernel.h's kernels, one launch per parameter part (Note [Quantize
  // kernels]).
  void quantize_kernels(const at::Tensor& mine, const at::Tensor& scales,
                        c10::Stream stream) const {
#if FLATSHARD_WITH_CUDA_KERNELS
    const cudaStream_t cs = cuda_stream(stream);
    const float* x = args_.master.data_ptr<float>();
    const float* s = scales.data_ptr<float>();
    uint8_t* q = mine.data_ptr<uint8_t>();
    for (const Local& l : local_)
      check_launch(kernels::fp8_quantize(x + l.begin, l.numel, s + l.param, q + l.begin, cs),
                   "fp8 quantize");
#else
    (void)mine, (void)scales, (void)stream;
    TORCH_INTERNAL_ASSERT(false, "fp8 quantize kernel without FLATSHARD_WITH_CUDA_KERNELS");
#endif
  }
  void dequantize_kernels(const at::Tensor& wire, const at::Tensor& scales,
                          c10::Stream stream) const {
#if FLATSHARD_WITH_CUDA_KERNELS
    const cudaStream_t cs = cuda_stream(stream);
    const uint8_t* q = wire.data_ptr<uint8_t>();
    const float* s = scales.data_ptr<float>();
    char* out = static_cast<char*>(args_.full.data_ptr());
    const int64_t elem = static_cast<int64_t>(args_.full.element_size());
    for (size_t i = 0; i < layout_.numels.size(); ++i) {
      const int64_t off = layout_.offsets[i], numel = layout_.numels[i];
      check_launch(kernels::fp8_dequantize(q + off, numel, s + i, out + off * elem, *kernel_, cs),
                   "fp8 dequantize");
    }
#else
    (void)wire, (void)scales, (void)stream;
    TORCH_INTERNAL_ASSERT(false, "fp8 dequantize kernel without FLATSHARD_WITH_CUDA_KERNELS");
#endif
  }

  // check_finite's values are the amax per parameter: `i` is the parameter.
  [[noreturn]] void report(int64_t i, int64_t count) const override {
    TORCH_CHECK(false, "unit '", unit_, "' (rank ", rank_, "): parameter ",
                param_name(static_cast<size_t>(i)),
                " holds inf or nan in its fp32 master (its amax over all shards is not finite), "
                "which the fp8 gather cannot carry; ",
                count,
                " parameter(s) of the unit are affected. Find where the values "
                "became non-finite (a loss spike, a learning rate too high), or gather in the "
                "param dtype (gather dtype param)");
  }

  std::vector<Local> local_;                       // this rank's parts of the parameters
  at::Tensor scales_;  // the last gather's, one per parameter (GatherExtras::fp8_scales)
  std::vector<std::pair<int64_t, int64_t>> gaps_;  // {begin, length} of full()'s padding
  bool delayed_;                                   // Note [Delayed fp8 amax]
  // Note [Delayed fp8 amax]: the amax per parameter (fp32 [P], on the master's device) the
  // last gather sent, maxed over the ranks; undefined before the first gather.
  at::Tensor last_amax_;
};

// int8: block-wise scales of the shard, packed with the data in one byte buffer per rank.
class Int8AllGather final : public QuantizedGather {
 public:
  using QuantizedGather::QuantizedGather;
  int64_t bytes() const override { return int8_wire_bytes(layout_.shard_numel); }
  void gather(c10::Stream stream) override {
    if (layout_.padded_numel == 0) return;
    const int64_t n = layout_.shard_numel, nb = int8_num_blocks(n), w = bytes();
    at::Tensor wire = at::empty({world_ * w}, args_.master.options().dtype(at::kByte));
    at::Tensor mine = wire.narrow(0, rank_ * w, w);
#if FLATSHARD_WITH_CUDA_KERNELS
    // Note [Quantize kernels]: one launch writes the slot's scales and data.
    if (kernel_)
      check_launch(
          kernels::int8_quantize(
              args_.master.data_ptr<float>(), n, reinterpret_cast<float*>(mine.data_ptr<uint8_t>()),
              reinterpret_cast<int8_t*>(mine.data_ptr<uint8_t>() + 4 * nb), cuda_stream(stream)),
          "int8 quantize");
#endif
    if (!kernel_) {
      const at::Tensor scales = int8_block_scales(args_.master);
      mine.narrow(0, 0, 4 * nb).view(at::kFloat).copy_(scales);
      mine.narrow(0, 4 * nb, n).view(at::kChar).copy_(int8_quantize(args_.master, scales));
    }
    if (w > 4 * nb + n) mine.narrow(0, 4 * nb + n, w - 4 * nb - n).zero_();
    comm_.all_gather(mine, wire, stream);
    const at::Tensor per_rank = wire.view({world_, w});
    const at::Tensor all_scales = per_rank.narrow(1, 0, 4 * nb).view(at::kFloat);  // [world, nb]
    check_finite(all_scales, stream);
#if FLATSHARD_WITH_CUDA_KERNELS
    if (kernel_) {
      check_launch(kernels::int8_dequantize(wire.data_ptr<uint8_t>(), w, n, world_,
                                            args_.full.data_ptr(), *kernel_, cuda_stream(stream)),
                   "int8 dequantize");
      return;
    }
#endif
    const at::Tensor all_data = per_rank.narrow(1, 4 * nb, n).view(at::kChar);  // [world, n]
    for (int r = 0; r < world_; ++r)
      args_.full.narrow(0, r * n, n)
          .copy_(int8_dequantize(all_data[r], all_scales[r], param_dtype_));
  }

 private:
  // check_finite's values are the gathered scales [world, blocks], the same on every rank:
  // every rank throws the same error.
  [[noreturn]] void report(int64_t first, int64_t count) const override {
    const int64_t nb = int8_num_blocks(layout_.shard_numel);
    const int64_t r = first / nb, b = first % nb;
    const int64_t begin = r * layout_.shard_numel + b * kInt8BlockSize;
    const int64_t end = std::min(begin + kInt8BlockSize, (r + 1) * layout_.shard_numel);
    TORCH_CHECK(false, "unit '", unit_, "' (rank ", rank_, "): the fp32 master of rank ", r,
                " holds inf or nan in int8 block ", b, " (flat elements [", begin, ", ", end,
                "), parameter(s) ", params_in(begin, end),
                "), which the int8 gather cannot "
                "carry; ",
                count,
                " block(s) of the unit are affected. Find where the "
                "values became non-finite (a loss spike, a learning rate too high), or gather "
                "in the param dtype (gather dtype param)");
  }
};

}  // namespace

int64_t quantized_gather_bytes(const FlatParamConfig& config, const FlatLayout& layout) {
  switch (config.gather_dtype) {
    case GatherDtype::kFp8:
      return layout.shard_numel + 4 * static_cast<int64_t>(layout.numels.size());
    case GatherDtype::kFp8Delayed:
      return fp8_delayed_wire_bytes(layout);
    case GatherDtype::kInt8:
      return int8_wire_bytes(layout.shard_numel);
    case GatherDtype::kParam:
      break;
  }
  return 0;
}

int64_t quantized_wire_buffer_bytes(const FlatParamConfig& config, const FlatLayout& layout) {
  if (!config.sharded) return 0;
  switch (config.gather_dtype) {
    case GatherDtype::kFp8:
      return layout.padded_numel;
    case GatherDtype::kFp8Delayed:
      return layout.world_size * fp8_delayed_wire_bytes(layout) + layout.padded_numel;
    case GatherDtype::kInt8:
      return layout.world_size * int8_wire_bytes(layout.shard_numel);
    case GatherDtype::kParam:
      break;
  }
  return 0;
}

std::unique_ptr<GatherPlan> make_quantized_gather(const std::string& unit_name,
                                                  const FlatParamConfig& config,
                                                  const FlatLayout& layout, Communicator& comm,
                                                  GatherArgs args) {
  TORCH_INTERNAL_ASSERT(config.sharded && config.offload == 0, "unit '", unit_name,
                        "': a quantized gather needs a sharded unit without offload");
  if (config.gather_dtype == GatherDtype::kFp8 || config.gather_dtype == GatherDtype::kFp8Delayed)
    return std::make_unique<Fp8AllGather>(unit_name, std::move(args), layout, config.param_dtype,
                                          comm, config.gather_dtype == GatherDtype::kFp8Delayed);
  TORCH_INTERNAL_ASSERT(config.gather_dtype == GatherDtype::kInt8);
  return std::make_unique<Int8AllGather>("Int8AllGather", unit_name, std::move(args), layout,
                                         config.param_dtype, comm);
}

}  // namespace flatshard

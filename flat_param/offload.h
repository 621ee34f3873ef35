// flatshard/flat_param/offload.h — host memory and host<->device copies for CPU offload.
//
// Note [CPU offload]
// A unit's FlatParamConfig::offload moves its optimizer-side state to the host (ZeRO-Offload,
// FSDP2's CPUOffloadPolicy), so a rank's device holds activations and gathered units, not the
// 16 bytes per parameter of fp32 master + gradient + AdamW moments.
// - Level 1: master() (the fp32 shard the optimizer steps) and master().grad() live in host
//   memory, pinned when the device is CUDA; an optimizer built over them keeps its state there
//   too and steps on the CPU (FusedAdamW: ATen's fused CPU kernel, one multithreaded pass per
//   list). The device keeps the shard in the compute dtype (`resident`, 2 B/element with
//   bf16), refreshed from the master at the unit's first gather after the master changed
//   (master_version(): an optimizer step, a checkpoint load): one H2D copy of the fp32 shard
//   into a transient device buffer and a cast on the device, on the all-gather stream, so it
//   rides the prefetch schedule. The all-gather reads `resident` (no cast per gather).
//   Why fp32 over PCIe and a device cast instead of a host cast and half the bytes: the host
//   cast is a CPU pass over every parameter on the thread that issues the step, while the
//   device cast runs at HBM speed beside compute; the copy itself is asynchronous.
// - Level 2: nothing stays on the device: every gather (forward, and backward when the unit
//   reshards after forward) uploads the fp32 master into the gathered buffer's own slot the
//   same way, then all-gathers in place. Twice the PCIe bytes of level 1 per step; the device
//   holds no per-unit memory between gathers.
// - Gradients: the reduction runs as without offload on the reduce stream (never the one-rank
//   shortcut, Note [One-rank reduction], which writes a device master gradient), then the fp32
//   shard is copied to the host gradient on the same stream without blocking the host. A
//   host gradient that already holds one (accumulation across steps without zero_grad) gets
//   the copy in a pinned staging buffer, added after the sync below.
// - The one host sync: the CPU optimizer must not read gradients still in flight, nor write a
//   master an upload still reads. At the end of each backward that reduced, the runtime waits
//   on the host for the compute stream, which by then waits for the last reduction (and every
//   gather of the step came before the computation that needed it), then finishes the staged
//   additions (HostGrad::finish()). Nothing else in the step blocks the host.
// - NO_SHARD units keep their compute copy on the device (their parameters are never freed);
//   level 2 acts as level 1 for them (fsdp/resolve.h).
// - Explain (planner/explain.h) counts host bytes per rank: master + gradient (+ AdamW state) for
//   offloaded units; device bytes: `resident` at level 1, none at level 2.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Stream.h>

namespace flatshard {

// An uninitialised 1-D host tensor of `numel` elements: pinned (page-locked with
// cudaHostRegister, exactly sized: Note [Exact pinned allocations] in offload.cpp) when
// `device` is CUDA, so copies to and from it run asynchronously; plain CPU memory otherwise
// (CPU ranks: host and device are the same memory). Allocation pins pages: allocate once.
at::Tensor host_empty(int64_t numel, at::ScalarType dtype, c10::Device device);

// `src` (fp32, host) into `dst` (any floating dtype, on the device) on the current stream,
// without blocking the host: an asynchronous H2D copy into a transient fp32 device buffer, then
// the cast on the device. A plain copy_ when both are on one device.
void upload_to_device(const at::Tensor& dst, const at::Tensor& src);
// The same, staged through transient device buffers of at most `chunk_numel` fp32 elements
// (the stream-ordered allocator reuses one block for all), so the upload adds at most that to
// the device's peak: for uploads that run beside backward (Note [Offload step in backward]).
void upload_to_device_chunked(const at::Tensor& dst, const at::Tensor& src, int64_t chunk_numel);

// `src` (on the device) into `dst` (host, pinned) on the current stream, asynchronously.
void download_to_host(const at::Tensor& dst, const at::Tensor& src);

}  // namespace flatshard

// flatshard/fsdp/unit_context.h — what a unit needs from the model it belongs to, and no more.
//
// FSDP2's FSDPCommContext: the runtime (fsdp/runtime.h) owns one per ShardedModel and every
// unit it drives holds a const reference to it. A unit reads its communicators, streams, tracer
// and the debug knobs of ShardingOptions it honours from here, and parks its reduction's buffers
// in the ReduceBuffers holder. Nothing here leads back to the runtime: control goes runtime ->
// unit, never up (CONTRIBUTING.md 4, "Control goes one way"). Gradient sync is not here: it
// changes between steps, so the runtime sets it on each unit (Unit::set_requires_grad_sync).
#pragma once

#include <c10/core/Stream.h>

#include <cstdint>

#include "collectives/mesh.h"
#include "fsdp/reduce_buffers.h"

namespace flatshard {

class OffloadLifecycle;
class Tracer;

struct UnitContext {
  // The model's rank layout (collectives/mesh.h): the shard group issues all-gathers,
  // reduce-scatters and NO_SHARD all-reduces; with HSDP gradients are also averaged across the
  // replicate group. Owned by the runtime.
  const Mesh& mesh;
  // Side streams, so collectives overlap compute (on CPU both are the default CPU stream).
  c10::Stream all_gather_stream;
  c10::Stream reduce_scatter_stream;
  Tracer* tracer;                  // nullptr unless tracing (fsdp/trace.h)
  ReduceBuffers& reduce_buffers;   // Note [Reduce buffer lifetime] (fsdp/reduce_buffers.h)
  // ShardingOptions' race-exposure sleeps (GPU only; 0 = off), queued before each collective.
  int64_t debug_sleep_before_all_gather_cycles = 0;
  int64_t debug_sleep_before_reduce_cycles = 0;
  // Note [CPU offload]'s lifecycle (fsdp/offload_step.h): each unit registers its flat
  // parameter at construction, and a reduction calls it before and after reduce_grad() (Note
  // [Offload step in backward]: an offloaded unit's CPU step is queued there). Owned by the
  // runtime; nullptr: no offload handling at all.
  OffloadLifecycle* offload = nullptr;

  // The stream compute runs on: the communicator's current stream, read at each use because
  // callers may switch it between steps.
  c10::Stream compute_stream() const { return mesh.shard().current_stream(); }
};

}  // namespace flatshard

// flatshard/fsdp/reduce_buffers.h — the compute-stream buffers a queued reduction still reads.
//
// Note [Reduce buffer lifetime]: a reduction reads buffers allocated on the compute stream (the
// flat gradient, and the gradients whose copy into it was deferred to the reduction). They are
// held here until the next reduction is issued (or backward ends), when the compute stream
// first waits for `done`; only then are they released to the allocator. This bounds pending
// reduce buffers to one unit's worth without recordStream.
//
// One holder per ShardedModel, owned by the runtime (fsdp/runtime.h) and handed to every unit
// through its UnitContext (fsdp/unit_context.h): a unit releases the previous unit's buffers
// before it issues its own reduction and holds its own after. Single-threaded like the runtime.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Stream.h>

#include <vector>

#include "fsdp/stream_event.h"

namespace flatshard {

class Tracer;

class ReduceBuffers {
 public:
  // Holds `buffers` until the next release(). `done` is recorded on the reduce stream after the
  // reduction that reads them; it belongs to the reducing unit and outlives the hold.
  void hold(std::vector<at::Tensor> buffers, const StreamEvent* done);
  // Makes `compute` wait for the held reduction (traced as kWaitReduce when `tracer` is set),
  // then releases its buffers to the allocator. Nothing held: nothing happens.
  void release(const c10::Stream& compute, Tracer* tracer);

 private:
  std::vector<at::Tensor> buffers_;
  const StreamEvent* done_ = nullptr;
};

}  // namespace flatshard

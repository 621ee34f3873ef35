#include "fsdp/reduce_buffers.h"

#include <c10/util/Exception.h>

#include "fsdp/trace.h"

namespace flatshard {

void ReduceBuffers::hold(std::vector<at::Tensor> buffers, const StreamEvent* done) {
  TORCH_INTERNAL_ASSERT(buffers_.empty(), "ReduceBuffers::release() not called first");
  buffers_ = std::move(buffers);
  done_ = done;
}

void ReduceBuffers::release(const c10::Stream& compute, Tracer* tracer) {
  if (done_ != nullptr) {
    TraceScope trace(tracer, TraceKind::kWaitReduce, nullptr);
    done_->block(compute);
  }
  buffers_.clear();
  done_ = nullptr;
}

}  // namespace flatshard

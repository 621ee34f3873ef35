// flatshard/fsdp/stream_event.h — a reusable event on a c10::Stream, a no-op on CPU.
//
// The CPU backend completes every collective before returning, so there is nothing to order;
// on CUDA this is a c10::Event (timing disabled) recorded on one stream and waited on by another
// with cudaStreamWaitEvent semantics — never a host sync.
#pragma once

#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <optional>

namespace flatshard {

class StreamEvent {
 public:
  void record(const c10::Stream& stream) {
    if (stream.device_type() == c10::DeviceType::CPU) return;
    if (!event_) event_.emplace(stream.device_type());
    event_->record(stream);
    recorded_ = true;
  }
  // Makes `stream` wait for the last record(); no-op if never recorded.
  void block(const c10::Stream& stream) const {
    if (recorded_ && event_) event_->block(stream);
  }
  bool recorded() const { return recorded_; }

 private:
  std::optional<c10::Event> event_;
  bool recorded_ = false;
};

// Convenience: make `waiter` wait for all work queued on `producer` so far.
inline void stream_wait_stream(const c10::Stream& waiter, const c10::Stream& producer,
                               StreamEvent& scratch) {
  if (waiter == producer) return;
  scratch.record(producer);
  scratch.block(waiter);
}

}  // namespace flatshard

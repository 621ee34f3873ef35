// flatshard/fsdp/deferred_init.h — fully_shard of a model built on the meta device: each unit is
// given memory, initialised and sharded in turn, so no rank ever holds the whole model.
//
//   flatshard::gpt::GPT model{nullptr};
//   { flatshard::MetaInit meta;  model = flatshard::gpt::GPT(cfg, seed); }  // shapes only, ~ms
//   auto fsdp = flatshard::fully_shard(model.ptr(), policy, comm);  // the GPT initialises itself
//
// Note [Deferred initialization]
// Why: eager setup builds every parameter on the host in fp32 before fully_shard copies it
// into flat buffers, so each rank first holds the whole model (a 6.7B GPT: 27 GB, ~140 s of
// host init before training) and nothing larger than about a quarter of one GPU can be
// sharded at all. FSDP2 builds on meta and initialises on the device; so does this.
// How (fsdp/setup.cpp, in setup order):
//   1. The setup fingerprint runs first, on shapes and device types only (it skips the values
//      of meta buffers), so ranks that disagree about which tensors are on meta fail there,
//      together. Then detection, the same on every rank: deferred iff some parameter or buffer
//      is on meta; then every parameter must be (a model partly on meta and partly on a device
//      is an error naming one of each).
//   2. Buffers (small: a rotary inv_freq) are materialised all at once on comm.device() and
//      initialised; that every meta tensor has an init is checked here too. One agree point
//      (collectives/agree.h). With sync_module_states off the fingerprint is taken again, now
//      comparing the buffers' values, as for an eager model.
//   3. Units in plan order: FlatParam allocates the unit's fp32 flat buffer, points each meta
//      parameter at its region (materialize_meta: the same TensorImpl, which modules, autograd
//      hooks, Plan::tied and the optimizer check key on), runs the init on each parameter,
//      checks the shapes and storages, agrees across ranks, then proceeds as for values copied
//      in: broadcast (sync_module_states), keep the shard, free the rest. The next unit starts
//      after this one's full buffer is gone. A tied parameter is one TensorImpl, claimed by one
//      unit, so it is initialised once, under the name the plan lists it by.
// Memory per rank during setup: its master shards so far + one unit's fp32 flat buffer + that
// unit's compute-dtype buffer (allocated briefly before it is freed) — tests/deferred_init_test
// checks the bound with the counting allocator; an eager setup exceeds it.
// Determinism: an init is a function of the tensor's name (and the model's seed), not of the
// order tensors are initialised in, so deferred values equal the eager model's at any world
// size; the GPT and LLaMA models draw each parameter from its own generator seeded by
// (seed, name) in eager construction and here alike (models/model_init.h).
// Errors: an init that throws, changes a tensor's shape or replaces its storage, and a meta
// tensor nothing can initialise, throw c10::Error on every rank at the next agree point,
// naming the unit (or buffer), the tensor and the rank that failed — not a hang. After such a
// failure the model is partly materialised: build a fresh one.
// Loading instead of an init: Note [Loading into shards] below.
//
// Note [Loading into shards]
// Why: a published model (one model.safetensors, or a model.safetensors.index.json over
// several files) loaded through an init would still fill each unit's whole fp32 flat buffer on
// every rank, reading every byte of the file world times, and then broadcast it. With
// ShardingOptions::load (fsdp/options.h: ParamLoader; checkpoint/load_into_shards.h makes one
// from safetensors files) each rank reads only the bytes of its own master shard.
// How (fsdp/setup.cpp, flat_param/flat_param.cpp):
//   1. Validate before reading: inside step 2's agree point, ParamLoader::check gets every
//      parameter of the plan (plan order, a tied one once) with its shape and throws naming
//      the tensor for a missing name, a wrong shape, a dtype it cannot convert, an unreadable
//      or truncated file; one rank's failure is every rank's error there, before any unit.
//      Buffers are not in published files as a rule (a rotary inv_freq): they still come from
//      the init of step 2 (ShardingOptions::init / InitializesItself); only parameters are
//      exempt from needing one.
//   2. Per unit, in plan order, FlatParam makes no full buffer: the master is zeros of this
//      rank's shard (padding zero), and for each parameter that intersects the shard the
//      loader reads elements [begin, end) of the flattened parameter into the master's slice
//      that holds them. Then the unit's agree point (a read that fails on one rank throws on
//      every rank, naming the unit, the rank and the cause), and construction goes on as
//      usual (views, full(), guards) with NO broadcast, even with sync_module_states: every
//      rank read its own part from the same file, and the shards are disjoint, so there is
//      nothing to make equal (HSDP: each replica reads its shards too).
// Memory per rank: its master shards + briefly one unit's compute-dtype full() + the loader's
// staging buffer (at most 64 MiB); no fp32 copy of any whole unit. Bytes read per rank: its
// shards' share of the file (tests/load_into_shards_test counts them).
// After a failure the model is partly materialised, as with an init: build a fresh one.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "collectives/mesh.h"
#include "fsdp/options.h"

namespace torch {
namespace nn {
class Module;
}
}  // namespace torch

namespace flatshard {

class Communicator;

// A module that can give any of its parameters and buffers initial values on its own, one at
// a time, in any order: the default init of deferred fully_shard for the tensors below it.
// Implemented by the GPT and LLaMA models (models/gpt.h, models/llama.h).
class InitializesItself {
 public:
  virtual ~InitializesItself() = default;
  // `name`: relative to this module, as its named_parameters() / named_buffers() spell it;
  // `values`: that tensor's shape and dtype, any device; filled in place. The same name must
  // give the same values every time (e.g. eager construction and deferred init); throws
  // c10::Error for a name this module does not own.
  virtual void init_tensor(const std::string& name, const at::Tensor& values) const = 0;
};

namespace detail {

// Whether `model` is to be initialised by fully_shard (some parameter or buffer on meta).
// Throws c10::Error naming one meta and one non-meta parameter when only some parameters are.
// Local; the same on every rank once the setup fingerprint agreed (it has the device types).
bool uses_deferred_init(const torch::nn::Module& model, int rank);

// The init of a deferred setup: ShardingOptions::init when set, else for each tensor its
// nearest enclosing InitializesItself module (with the name relative to it).
class DeferredInit {
 public:
  // `params_loaded`: a ParamLoader gives the parameters their values (Note [Loading into
  // shards]); then only the buffers need an init.
  DeferredInit(torch::nn::Module& model, TensorInit user, bool params_loaded = false);
  // Fills tensor `name` (a parameter or buffer of the model) in place; errors name it.
  void init(const std::string& name, const at::Tensor& values) const;
  // Step 2 of the Note: collective over the mesh's groups (collectives/agree.h).
  // `check_first` (may be empty) runs first, inside the same agree point: the loader's check.
  void materialize_buffers(torch::nn::Module& model, const Mesh& mesh,
                           const std::function<void()>& check_first = {}) const;

 private:
  // Throws naming the first meta parameter or buffer nothing can initialise.
  void check_every_tensor_has_init(const torch::nn::Module& model) const;
  const InitializesItself* owner(const std::string& name, std::string* relative) const;

  TensorInit user_;
  bool params_loaded_ = false;
  // Modules that initialise themselves, by path ("" = the model), deepest first.
  std::vector<std::pair<std::string, const InitializesItself*>> self_init_;
};

}  // namespace detail
}  // namespace flatshard

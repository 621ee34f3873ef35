// flatshard/fsdp/deferred_init.cpp — see deferred_init.h (Note [Deferred initialization]).
#include "fsdp/deferred_init.h"

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <algorithm>

#include "collectives/agree.h"
#include "collectives/communicator.h"
#include "flat_param/flat_param.h"

namespace flatshard {
namespace detail {

bool uses_deferred_init(const torch::nn::Module& model, int rank) {
  std::string meta_param, device_param;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    std::string& slot = item.value().is_meta() ? meta_param : device_param;
    if (slot.empty()) slot = item.key();
  }
  bool meta_buffer = false;
  for (const auto& item : model.named_buffers(/*recurse=*/true))
    meta_buffer = meta_buffer || (item.value().defined() && item.value().is_meta());
  if (meta_param.empty() && !meta_buffer) return false;
  TORCH_CHECK(device_param.empty(), "fully_shard: parameter '", meta_param,
              "' is on meta (it holds no values) but parameter '", device_param, "' is on ",
              model.named_parameters(true)[device_param].device(), " (rank ", rank,
              "): move the model there, all of it, before sharding it, or build all of it on "
              "the meta device (flatshard::MetaInit) for deferred initialization");
  return true;
}

DeferredInit::DeferredInit(torch::nn::Module& model, TensorInit user, bool params_loaded)
    : user_(std::move(user)), params_loaded_(params_loaded) {
  if (user_) return;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    if (const auto* s = dynamic_cast<const InitializesItself*>(item.value().get()))
      self_init_.emplace_back(item.key(), s);
  }
  std::stable_sort(self_init_.begin(), self_init_.end(),
                   [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
}

const InitializesItself* DeferredInit::owner(const std::string& name,
                                             std::string* relative) const {
  for (const auto& [path, module] : self_init_) {
    if (path.empty()) {
      *relative = name;
      return module;
    }
    if (name.size() > path.size() && name.compare(0, path.size(), path) == 0 &&
        name[path.size()] == '.') {
      *relative = name.substr(path.size() + 1);
      return module;
    }
  }
  return nullptr;
}

void DeferredInit::init(const std::string& name, const at::Tensor& values) const {
  at::NoGradGuard no_grad;
  const std::vector<int64_t> shape = values.sizes().vec();
  const void* data = values.data_ptr();
  try {
    if (user_) {
      user_(name, values);
    } else {
      std::string relative;
      const InitializesItself* m = owner(name, &relative);
      TORCH_CHECK(m != nullptr, "no module above it initialises itself");
      m->init_tensor(relative, values);
    }
    TORCH_CHECK(values.sizes() == shape && values.data_ptr() == data, "it resized the tensor ",
                "it was given from ", c10::IntArrayRef(shape), " to ", values.sizes(),
                "; an init must write the values in place, keeping the shape");
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "init of '", name, "': ", e.msg());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "init of '", name, "' threw: ", e.what());
  }
}

void DeferredInit::check_every_tensor_has_init(const torch::nn::Module& model) const {
  if (user_) return;
  std::string relative;
  auto check = [&](const std::string& name, const char* kind) {
    TORCH_CHECK(owner(name, &relative) != nullptr, kind, " '", name,
                "' is on the meta device and nothing can initialise it: no module above it "
                "implements flatshard::InitializesItself. Pass ShardingOptions::init, or build "
                "the model eagerly");
  };
  if (!params_loaded_)
    for (const auto& item : model.named_parameters(/*recurse=*/true))
      if (item.value().is_meta()) check(item.key(), "parameter");
  for (const auto& item : model.named_buffers(/*recurse=*/true))
    if (item.value().defined() && item.value().is_meta()) check(item.key(), "buffer");
}

void DeferredInit::materialize_buffers(torch::nn::Module& model, const Mesh& mesh,
                                       const std::function<void()>& check_first) const {
  Communicator& comm = mesh.shard();
  const std::string what =
      check_first ? "fully_shard: loading (the loader's check of every parameter) and "
                    "deferred initialization of the buffers"
                  : "fully_shard: deferred initialization (the buffers; an init for every "
                    "meta tensor)";
  run_agreed(mesh, what, [&] {
    at::NoGradGuard no_grad;
    if (check_first) check_first();
    check_every_tensor_has_init(model);
    for (auto& item : model.named_buffers(/*recurse=*/true)) {
      const at::Tensor& b = item.value();
      if (!b.defined() || !b.is_meta()) continue;
      const at::Tensor values =
          at::empty(b.sizes(), at::TensorOptions().dtype(b.scalar_type()).device(comm.device()));
      init(item.key(), values);
      TORCH_CHECK(values.sizes() == b.sizes() && values.scalar_type() == b.scalar_type(),
                  "initialising buffer '", item.key(), "' changed it from ", b.sizes(), " ",
                  b.scalar_type(), " to ", values.sizes(), " ", values.scalar_type(),
                  "; an init must fill the tensor it is given in place");
      materialize_meta(b, values, "buffer '" + item.key() + "'");
    }
  });
}

}  // namespace detail
}  // namespace flatshard

#include "checkpoint/optimizer_state.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <memory>
#include <unordered_set>

namespace flatshard {

namespace {

template <class Options>
OptimizerRecord describe(const torch::optim::Optimizer& opt, const char* type) {
  OptimizerRecord r;
  r.type = type;
  const auto& groups = opt.param_groups();
  TORCH_CHECK(!groups.empty(), "checkpoint: the ", type, " optimizer has no parameter groups");
  const auto& first = static_cast<const Options&>(groups.front().options());
  r.lr = first.lr();
  r.beta1 = std::get<0>(first.betas());
  r.beta2 = std::get<1>(first.betas());
  r.eps = first.eps();
  r.weight_decay = first.weight_decay();
  for (const auto& g : groups)
    r.amsgrad = r.amsgrad || static_cast<const Options&>(g.options()).amsgrad();
  r.fields = {"exp_avg", "exp_avg_sq"};
  if (r.amsgrad) r.fields.push_back("max_exp_avg_sq");
  return r;
}

template <class State>
int64_t get(const torch::optim::OptimizerParamState& base, std::vector<at::Tensor>& fields) {
  const auto& s = static_cast<const State&>(base);
  fields[0] = s.exp_avg();
  fields[1] = s.exp_avg_sq();
  if (fields.size() > 2) fields[2] = s.max_exp_avg_sq();
  return s.step();
}

template <class State>
std::unique_ptr<torch::optim::OptimizerParamState> make(int64_t step,
                                                        std::vector<at::Tensor>& fields) {
  auto s = std::make_unique<State>();
  s->step(step);
  s->exp_avg(fields[0]);
  s->exp_avg_sq(fields[1]);
  if (fields.size() > 2) s->max_exp_avg_sq(fields[2]);
  return s;
}

bool is_adamw(const torch::optim::Optimizer& opt) {
  return dynamic_cast<const torch::optim::AdamW*>(&opt) != nullptr;
}

}  // namespace

OptimizerRecord describe_optimizer(const torch::optim::Optimizer& opt) {
  if (is_adamw(opt)) return describe<torch::optim::AdamWOptions>(opt, "AdamW");
  if (dynamic_cast<const torch::optim::Adam*>(&opt))
    return describe<torch::optim::AdamOptions>(opt, "Adam");
  TORCH_CHECK(false,
              "checkpoint: saving the state of this optimizer type is not supported "
              "(Adam and AdamW are); pass nullptr to save or load the model alone");
}

int64_t get_optimizer_state(const torch::optim::Optimizer& opt, const OptimizerRecord& record,
                            const at::Tensor& param, std::vector<at::Tensor>& fields) {
  fields.assign(record.fields.size(), at::Tensor());
  auto it = opt.state().find(param.unsafeGetTensorImpl());
  if (it == opt.state().end()) return 0;
  const int64_t step = is_adamw(opt) ? get<torch::optim::AdamWParamState>(*it->second, fields)
                                     : get<torch::optim::AdamParamState>(*it->second, fields);
  // Note [Low-precision moments] (optim/fused_adamw.h): state kept narrower than its parameter
  // (bf16 moments of an fp32 master) is saved in the parameter's dtype, exactly (a widening),
  // so the files' layout does not depend on the optimizer's storage; the optimizer narrows it
  // again at its next step, to the same values.
  for (auto& f : fields)
    if (f.defined() && f.scalar_type() != param.scalar_type()) f = f.to(param.scalar_type());
  return step;
}

void set_optimizer_state(torch::optim::Optimizer& opt, const OptimizerRecord& record,
                         const at::Tensor& param, int64_t step, std::vector<at::Tensor> fields) {
  void* key = param.unsafeGetTensorImpl();
  opt.state().erase(key);
  if (step == 0) return;
  TORCH_INTERNAL_ASSERT(fields.size() == record.fields.size());
  opt.state()[key] = is_adamw(opt) ? make<torch::optim::AdamWParamState>(step, fields)
                                   : make<torch::optim::AdamParamState>(step, fields);
}

namespace {

std::unordered_set<const c10::TensorImpl*> held_params(const torch::optim::Optimizer& opt) {
  std::unordered_set<const c10::TensorImpl*> held;
  for (const auto& g : opt.param_groups())
    for (const auto& p : g.params()) held.insert(p.unsafeGetTensorImpl());
  return held;
}

// The indices of `flat`'s shard views the optimizer holds (empty when it holds the master).
std::vector<size_t> held_views(const torch::optim::Optimizer& opt, const FlatParam& flat,
                               bool& holds_master) {
  const auto held = held_params(opt);
  holds_master = held.count(flat.master().unsafeGetTensorImpl()) > 0;
  std::vector<size_t> views;
  if (holds_master) return views;
  for (size_t i = 0; i < flat.shard_views().size(); ++i)
    if (flat.trainable(i) && held.count(flat.shard_views()[i].tensor.unsafeGetTensorImpl()))
      views.push_back(i);
  TORCH_CHECK(!views.empty() || !flat.any_trainable() || flat.layout().padded_numel == 0,
              "checkpoint: the optimizer holds neither the master shard of unit '",
              flat.unit_name(), "' nor views of its parameters; build it on "
              "ShardedModel::parameters() or named_parameters() of this model");
  return views;
}

}  // namespace

void check_optimizer_holds(const torch::optim::Optimizer& opt, const FlatParam& flat) {
  bool holds_master = false;
  held_views(opt, flat, holds_master);
}

int64_t get_unit_optimizer_state(const torch::optim::Optimizer& opt, const OptimizerRecord& record,
                                 const FlatParam& flat, std::vector<at::Tensor>& fields) {
  fields.assign(record.fields.size(), at::Tensor());
  if (flat.layout().padded_numel == 0 || !flat.any_trainable()) return 0;
  bool holds_master = false;
  const std::vector<size_t> views = held_views(opt, flat, holds_master);
  if (holds_master) return get_optimizer_state(opt, record, flat.master(), fields);
  int64_t step = 0;
  std::string first;  // the view whose step the others must match
  std::vector<at::Tensor> one;
  for (size_t i : views) {
    const ShardView& v = flat.shard_views()[i];
    const int64_t s = get_optimizer_state(opt, record, v.tensor, one);
    if (s == 0) continue;
    TORCH_CHECK(first.empty() || s == step, "checkpoint: unit '", flat.unit_name(),
                "' holds parameters at different optimizer step counts: '", first, "' (", step,
                ") and '", flat.params()[i].name, "' (", s, "); a unit's state is saved with one "
                "step count");
    if (first.empty()) {
      first = flat.params()[i].name;
      step = s;
      for (auto& f : fields) f = at::zeros_like(flat.master().detach());
    }
    for (size_t k = 0; k < fields.size(); ++k)
      if (one[k].defined()) fields[k].narrow(0, v.begin, v.numel()).copy_(one[k].reshape({-1}));
  }
  return step;
}

void set_unit_optimizer_state(torch::optim::Optimizer& opt, const OptimizerRecord& record,
                              const FlatParam& flat, int64_t step,
                              const std::vector<at::Tensor>& fields) {
  if (flat.layout().padded_numel == 0 || !flat.any_trainable()) return;
  bool holds_master = false;
  const std::vector<size_t> views = held_views(opt, flat, holds_master);
  if (holds_master) return set_optimizer_state(opt, record, flat.master(), step, fields);
  for (size_t i : views) {
    const ShardView& v = flat.shard_views()[i];
    std::vector<at::Tensor> slice;
    for (const auto& f : fields) slice.push_back(f.narrow(0, v.begin, v.numel()).clone());
    set_optimizer_state(opt, record, v.tensor, step, std::move(slice));
  }
}

}  // namespace flatshard

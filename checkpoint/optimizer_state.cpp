#include "checkpoint/optimizer_state.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <memory>

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

void check_optimizer_holds(const torch::optim::Optimizer& opt, const at::Tensor& param,
                           const std::string& unit) {
  for (const auto& g : opt.param_groups())
    for (const auto& p : g.params())
      if (p.unsafeGetTensorImpl() == param.unsafeGetTensorImpl()) return;
  TORCH_CHECK(false, "checkpoint: the optimizer does not hold the master shard of unit '", unit,
              "'; build it on ShardedModel::parameters() of this model");
}

int64_t get_optimizer_state(const torch::optim::Optimizer& opt, const OptimizerRecord& record,
                            const at::Tensor& param, std::vector<at::Tensor>& fields) {
  fields.assign(record.fields.size(), at::Tensor());
  auto it = opt.state().find(param.unsafeGetTensorImpl());
  if (it == opt.state().end()) return 0;
  return is_adamw(opt) ? get<torch::optim::AdamWParamState>(*it->second, fields)
                       : get<torch::optim::AdamParamState>(*it->second, fields);
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

}  // namespace flatshard

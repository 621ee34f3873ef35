// flatshard/fsdp/recompute.cpp — the recompute node (Note [Recompute], fsdp/recompute.h).
#include "fsdp/recompute.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <mutex>

#include "fsdp/runtime.h"
#include "fsdp/unit.h"

namespace flatshard {
namespace detail {

namespace {

at::Tensor read_state(at::Generator gen) {  // a handle: get_state is not const
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void write_state(at::Generator gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// For the recompute: sets the forward's generator states, and puts back on exit (also when the
// recompute throws) the states it found, so backward leaves the caller's random stream alone.
class RngFork {
 public:
  explicit RngFork(const RngStates& forward) : forward_(forward) {
    cpu_ = read_state(at::detail::getDefaultCPUGenerator());
    write_state(at::detail::getDefaultCPUGenerator(), forward_.cpu);
    if (forward_.device.defined()) {
      at::Generator gen = at::globalContext().defaultGenerator(forward_.device_id);
      device_ = read_state(gen);
      write_state(gen, forward_.device);
    }
  }
  ~RngFork() {
    try {
      write_state(at::detail::getDefaultCPUGenerator(), cpu_);
      if (device_.defined())
        write_state(at::globalContext().defaultGenerator(forward_.device_id), device_);
    } catch (...) {  // no throw from destructors (CONTRIBUTING.md 5): set_state of a valid
                     // state
    }
  }
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;

 private:
  const RngStates& forward_;
  at::Tensor cpu_, device_;
};

// What the node needs in backward, held by its context (a capsule in saved_data).
struct RecomputeState : torch::CustomClassHolder {
  UnitEntry entry;
  const torch::nn::Module* member = nullptr;
  RecomputeFn fn;
  RngStates rng;
  size_t num_inputs = 0;              // the tensor arguments; the member's parameters follow
  std::vector<size_t> defined_index;  // forward output k is flattened output defined_index[k]
  std::vector<at::Tensor> outputs;    // the no-grad forward's outputs, until forward() returns
};

struct RecomputeFunction : public torch::autograd::Function<RecomputeFunction> {
  // `all`: the tensor arguments, then the member's parameters (the node's edges).
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::IValue& state, at::TensorList all) {
    auto* st = static_cast<RecomputeState*>(state.toCapsule().get());
    ctx->saved_data["state"] = state;
    ctx->save_for_backward(all.slice(0, st->num_inputs).vec());
    ctx->set_materialize_grads(false);
    return std::move(st->outputs);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto holder = ctx->saved_data["state"].toCapsule();
    auto* st = static_cast<RecomputeState*>(holder.get());
    Unit& unit = *st->entry.unit;
    // The unit's pre-backward ran first: a pre-hook on this node, or the PreBackward identity
    // on its outputs (Note [Pre-backward hook], fsdp/runtime.cpp).
    TORCH_INTERNAL_ASSERT(unit.state() == UnitState::kUnsharded, "unit '", unit.name(),
                          "': recompute found the unit sharded (its pre-backward did not run)");
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    std::vector<at::Tensor> inputs;
    inputs.reserve(saved.size());
    for (const at::Tensor& t : saved)
      inputs.push_back(t.defined() ? t.detach().requires_grad_(t.requires_grad()) : t);

    std::vector<at::Tensor> outputs;
    {
      RngFork fork(st->rng);
      at::AutoGradMode grad(true);
      outputs = st->fn(inputs);
    }
    std::vector<at::Tensor> roots, root_grads;
    for (size_t k = 0; k < st->defined_index.size() && k < grads.size(); ++k) {
      const size_t j = st->defined_index[k];
      TORCH_CHECK(j < outputs.size() && outputs[j].defined(), "unit '", unit.name(),
                  "': the recomputed forward returned a different set of tensors than the "
                  "first run (output ",
                  j, ")");
      if (grads[k].defined() && outputs[j].requires_grad()) {
        roots.push_back(outputs[j]);
        root_grads.push_back(grads[k]);
      }
    }
    // Slot 0 is the state (no gradient); slot 1 + i is tensor i of `all`.
    const std::vector<at::Tensor>& leaves = unit.recompute_leaves(st->member);
    torch::autograd::variable_list result(1 + st->num_inputs + leaves.size());
    std::vector<at::Tensor> wrt;
    std::vector<size_t> slot;
    for (size_t i = 0; i < st->num_inputs + leaves.size(); ++i) {
      if (!ctx->needs_input_grad(i)) continue;
      wrt.push_back(i < st->num_inputs ? inputs[i] : leaves[i - st->num_inputs]);
      slot.push_back(1 + i);
    }
    if (roots.empty() || wrt.empty()) return result;
    const auto g = torch::autograd::grad(roots, wrt, root_grads, /*retain_graph=*/false,
                                         /*create_graph=*/false, /*allow_unused=*/true);
    for (size_t k = 0; k < g.size(); ++k) result[slot[k]] = g[k];
    return result;
  }
};

}  // namespace

bool recompute_active(const UnitEntry& e) {
  return e.unit->recompute() && at::GradMode::is_enabled();
}

void reject_enter_recompute(const UnitEntry& e) {
  TORCH_CHECK(false, "flatshard::enter: unit '", e.unit->name(),
              "' has the recompute option; enter it with flatshard::call(module, args...) so its "
              "tensor arguments are known to the recompute (Note [Recompute]), or drop the "
              "option for this unit");
}

RngStates save_rng_states(const UnitEntry& e) {
  RngStates s;
  s.cpu = read_state(at::detail::getDefaultCPUGenerator());
  const c10::Device device = e.runtime->comm().device();
  if (device.is_cuda()) {
    s.device_id = device;
    s.device = read_state(at::globalContext().defaultGenerator(device));
  }
  return s;
}

std::vector<at::Tensor> attach_recompute(const UnitEntry& e, const torch::nn::Module* member,
                                         std::vector<at::Tensor> inputs,
                                         std::vector<at::Tensor> outputs, RecomputeFn fn,
                                         RngStates rng) {
  auto st = c10::make_intrusive<RecomputeState>();
  st->entry = e;
  st->member = member;
  st->fn = std::move(fn);
  st->rng = std::move(rng);
  st->num_inputs = inputs.size();
  for (size_t j = 0; j < outputs.size(); ++j)
    if (outputs[j].defined()) {
      st->defined_index.push_back(j);
      st->outputs.push_back(outputs[j]);
    }
  std::vector<at::Tensor> all = std::move(inputs);
  const std::vector<at::Tensor>& leaves = e.unit->recompute_leaves(member);
  all.insert(all.end(), leaves.begin(), leaves.end());
  const std::vector<size_t> index = st->defined_index;
  torch::autograd::variable_list wrapped =
      RecomputeFunction::apply(at::IValue::make_capsule(std::move(st)), at::TensorList(all));
  for (size_t k = 0; k < index.size(); ++k) outputs[index[k]] = wrapped[k];
  return outputs;
}

}  // namespace detail
}  // namespace flatshard

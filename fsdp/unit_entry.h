// flatshard/fsdp/unit_entry.h — a registered member module's unit and the runtime that drives
// it: what flatshard::call (fsdp/call.h) and the recompute path (fsdp/recompute.h) are handed.
// Its own header so that neither of the two includes the other for it.
//
// Contract
//   * find_unit(m): unit == nullptr when `m` is not a unit member of a live ShardedModel (the
//     common, cheap case; fsdp/call.cpp keeps the registry).
#pragma once

namespace torch {
namespace nn {
class Module;
}
}  // namespace torch

namespace flatshard {

class Runtime;
class Unit;

namespace detail {

struct UnitEntry {
  Runtime* runtime = nullptr;
  Unit* unit = nullptr;
};

UnitEntry find_unit(const torch::nn::Module* m);

}  // namespace detail
}  // namespace flatshard

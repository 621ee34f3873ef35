// flatshard/fsdp/meta_init.cpp — see meta_init.h.
#include "fsdp/meta_init.h"

#include <torch/nn/module.h>

namespace flatshard {

void check_on_meta(const torch::nn::Module& module) {
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    TORCH_CHECK(item.value().is_meta(), "check_on_meta: parameter '", item.key(), "' is on ",
                item.value().device(), ", not meta; its module allocated it without going "
                "through the dispatcher, so MetaInit cannot keep it off the host");
  }
}

}  // namespace flatshard

// flatshard/planner/model_shape.cpp — see model_shape.h for the contract.
#include "planner/model_shape.h"

#include <c10/util/Exception.h>

#include <cmath>

namespace flatshard {

namespace {

void check_per_token(const PerToken& t, const char* field) {
  TORCH_CHECK(
      std::isfinite(t.per_element) && std::isfinite(t.fixed) && t.per_element >= 0 && t.fixed >= 0,
      "TransformerShape: ", field, " must be finite and >= 0, got per_element ", t.per_element,
      " fixed ", t.fixed);
}

}  // namespace

void TransformerShape::validate() const {
  TORCH_CHECK(vocab > 0 && d_model > 0 && n_layers > 0 && layer_matmul_params > 0,
              "TransformerShape: vocab, d_model, n_layers and layer_matmul_params must be > 0, "
              "got vocab ",
              vocab, " d_model ", d_model, " n_layers ", n_layers, " layer_matmul_params ",
              layer_matmul_params);
  TORCH_CHECK(!layer_prefix.empty(),
              "TransformerShape: layer_prefix (the module path of the layer list) is empty");
  TORCH_CHECK(std::isfinite(attention_flops_per_token_per_position) &&
                  attention_flops_per_token_per_position >= 0,
              "TransformerShape: attention_flops_per_token_per_position must be finite and >= 0, "
              "got ",
              attention_flops_per_token_per_position);
  check_per_token(layer_activations, "layer_activations");
  check_per_token(recompute_keeps, "recompute_keeps");
  check_per_token(layer_backward_work, "layer_backward_work");
  check_per_token(head_activations, "head_activations");
  for (const auto& [path, bytes] : recomputed_leaf_savings)
    TORCH_CHECK(std::isfinite(bytes) && bytes >= 0, "TransformerShape: the recomputed saving of '",
                path, "' must be finite and >= 0, got ", bytes);
}

}  // namespace flatshard

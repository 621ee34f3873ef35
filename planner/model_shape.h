// flatshard/planner/model_shape.h — what the cost model (planner/cost_model.h) and the advisor
// (planner/advisor.h) need to know about a transformer, as plain data.
//
// The planner knows no model family and no module name: whoever describes the model fills this
// in — a family of models/ (models/family.h: Family::shape), or the description of a checkpoint
// read from its files (tools/explain_main.cpp: --weights with a config.json). Everything
// family-specific is a number or a path here; the closed forms behind the numbers live with the
// family that has them (models/gpt.cpp, models/llama.cpp).
//
// Contract
//   * Paths are module paths of the planned model (as Plan::units' module lists spell them).
//     layer_prefix names the layer list: a unit module "<layer_prefix>.<i>" is layer i,
//     "<layer_prefix>.<i>.<inner>" is a part of it. input_modules run before the first layer
//     (embeddings, rotary tables): a unit holding only these (or modules below them) is placed
//     first. head_modules hold the output projection: the unit that holds one of them (or a
//     module below it) computes the head.
//   * PerToken: bytes per token of one layer as per_element x e + fixed, where e is the element
//     size of the compute dtype (2 for bf16, 4 for fp32): what the activations of a layer cost
//     at any mixed-precision setting.
//   * validate() throws c10::Error naming the first bad field: positive vocab, d_model,
//     n_layers, layer_matmul_params; non-negative finite per-token terms; a non-empty
//     layer_prefix.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace flatshard {

struct PerToken {
  double per_element = 0;  // times the compute dtype's element size
  double fixed = 0;        // bytes whatever the dtype (fp32 statistics, indices)
  double bytes(int64_t element_size) const {
    return per_element * static_cast<double>(element_size) + fixed;
  }
};

struct TransformerShape {
  // The head's sizes: the output projection is [vocab, d_model]; its input, the logits and the
  // loss's fp32 copies are what the walk counts at the loss (cost_model.h).
  int64_t vocab = 0, d_model = 0;
  int64_t n_layers = 0;

  std::string layer_prefix;                // "blocks", "layers", "model.layers"
  std::vector<std::string> input_modules;  // "wte", "wpe" / "embed_tokens", "rope"
  std::vector<std::string> head_modules;   // "lm_head"

  // Spec type names the advisor builds its candidates from ("Block",
  // "Linear|LayerNorm|Embedding"); leaf_types may be empty (no per-leaf candidate).
  std::string layer_type, leaf_types;

  // One layer, closed forms of its family:
  int64_t layer_matmul_params = 0;  // matmul weight elements (the FLOP count's N per layer)
  // Attention score and value matmuls per token: this x the sequence length (12 d for the
  // PaLM convention, models/gpt.h flops_per_token).
  double attention_flops_per_token_per_position = 0;
  PerToken layer_activations;    // what autograd saves per token for the layer's backward
  PerToken recompute_keeps;      // what a recompute unit holding the whole layer keeps (its input)
  PerToken layer_backward_work;  // the backward's working set per token (largest temporaries)
  // Paths inside a layer of modules that, recomputed as units of their own, keep less than
  // they would save otherwise: bytes per token saved (LLaMA's RMSNorms keep their input, not
  // the fp32 copy, the cast output and the statistic).
  std::vector<std::pair<std::string, double>> recomputed_leaf_savings;
  // What the head saves per token (its norm's input, the projection's input, the fp32
  // log-softmax): 2 d e + 4 V for the reference families.
  PerToken head_activations;

  void validate() const;
};

}  // namespace flatshard

// flatshard/wrap_policies/tp_plan.h — which modules tensor parallelism splits, and how: a TP plan.
//
// A TpPlan is plain data, like a wrap Policy (policy.h): an ordered list of rules, each a style
// and the terms (type=, path=, size>=, as in spec.h) a module must match; the FIRST rule whose
// terms all hold on a module gives its style. parallelize() (fsdp/tensor_parallel.h) applies it.
//
//   colwise      a Linear-like module (a 2-D `weight` [out, in], an optional 1-D `bias` [out])
//                split along its OUTPUT features: each tp rank keeps out / tp rows of the weight
//                (and of the bias). Its input is replicated; forward identity, backward
//                all-reduce of the input gradient over the tp group (Megatron's f).
//   colwise/K    the same for a fused output of K equal blocks (GPT's qkv, K = 3): each rank
//                keeps its out / (K * tp) rows of EVERY block, so each block stays head-aligned.
//   rowwise      split along its INPUT features: each rank keeps in / tp columns of the weight;
//                the bias is replicated. Forward all-reduce of the output over the tp group,
//                backward identity (Megatron's g). Its input must be TP-sharded (the output of
//                a colwise module, through elementwise ops or the attention of local heads).
//   vocab        an Embedding-like module (a 2-D `weight` [vocab, d], nothing else) split along
//                its ROWS, the vocabulary (Megatron's VocabParallelEmbedding): tp rank k keeps
//                rows [k*V/tp, (k+1)*V/tp) and looks up the ids in that range (others give zero
//                rows); forward all-reduce of the output over the tp group, backward local.
//                Untied embeddings only; not combined with sequence_parallel yet.
//   replicate    kept whole on every tp rank (what every module the plan does not name is); a
//                rule of its own claims modules so later rules skip them.
//   sequence     kept whole like replicate, and a module that runs on sequence shards under
//                sequence parallelism (norms: torchtitan's SequenceParallel): with the plan's
//                sequence_parallel option its parameters' gradients are summed over the tp group
//                (each rank saw only its part of the sequence). Without the option, replicate.
//
// Options (items without terms, anywhere in the plan; to_spec() prints them last):
//   sequence_parallel  Megatron's sequence parallelism: between the split blocks activations
//                      are sharded along the sequence (dim 1 of [B, T, ...]); a colwise module's
//                      input is all-gathered along it, a rowwise module's output reduce-scattered
//                      (backward: the duals) instead of f/g's all-reduces. Needs a `sequence` rule.
//   loss_parallel      vocabulary-parallel cross-entropy on a colwise lm_head: the logits stay
//                      split by vocabulary (no gathered logits); the families' loss() uses it.
//
// Text form (the terms are spec.h's, `every` excepted; errors have its column and caret form,
// starting "tp plan:"):
//   plan  := 'none' | item (';' item)*
//   item  := style ':' term (',' term)* | 'sequence_parallel' | 'loss_parallel'
//   style := 'colwise' ['/' K] | 'rowwise' | 'vocab' | 'replicate' | 'sequence'   K: 2..64
// Example (flatshard's LLaMA; its Hugging Face names match too, Note [Module aliases]):
//   colwise:path=*.attn.q|*.attn.k|*.attn.v|*.mlp.gate|*.mlp.up;rowwise:path=*.attn.o|*.mlp.down
// to_spec() prints a plan back in this form; parse_tp_plan(to_spec()) gives back an equal plan.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "wrap_policies/policy.h"

namespace flatshard {

enum class TpStyle : uint8_t {
  kReplicate = 0,
  kColwise = 1,
  kRowwise = 2,
  kSequence = 3,
  kVocab = 4
};
const char* to_string(TpStyle style);

struct TpRule {
  TpStyle style = TpStyle::kReplicate;
  int parts = 1;  // colwise/K: K fused output blocks; 1 otherwise
  Rule match;     // its terms; every == 1, default options
};

struct TpPlan {
  std::vector<TpRule> rules;  // the first rule whose terms match a module gives its style
  bool sequence_parallel = false;  // the option above; off: f/g's all-reduces
  bool loss_parallel = false;      // the option above; off: the loss sees gathered logits

  bool empty() const { return rules.empty() && !sequence_parallel && !loss_parallel; }
  // The text form above ("none" when empty).
  std::string to_spec() const;
  // The rules' terms as a Policy, one Rule per TpRule in order: what a PolicyMatcher
  // (match.h) compiles, so rule r of the matcher is rules[r].
  Policy match_policy() const;
};

TpPlan parse_tp_plan(const std::string& spec);

// The style text of one rule ("colwise", "colwise/3").
std::string style_text(const TpRule& rule);

}  // namespace flatshard

// flatshard/wrap_policies/spec.h — the text form of a Policy, for command lines.
//
//   spec    := 'none' | item (';' item)*
//   item    := 'root' ':' strategy               options of the root unit (at most once)
//            | [options ':'] term (',' term)*    one rule; terms are AND-ed
//   options := option ('+' option)*              at most one strategy, one 'recompute', one
//                                                offload, one gather
//   option  := strategy | 'recompute' | offload | gather
//   strategy:= 'noshard' | 'grad_op' | 'full' | 'keep'
//                noshard    NO_SHARD (replicated; gradients all-reduced)
//                grad_op    SHARD_GRAD_OP
//                full       FULL_SHARD
//                keep       FULL_SHARD without reshard after forward
//                recompute  activation checkpointing: the unit's forward keeps no activations and
//                           runs again in its backward (Note [Recompute], fsdp/recompute.h);
//                           alone ("recompute:type=Block", the default strategy) or with a
//                           strategy in either order ("keep+recompute:type=Block"). Not on the
//                           root ("root:recompute" is an error).
//   offload := 'offload' | 'offload1' | 'offload2' | 'offload0'
//                           CPU offload of the rule's units (Note [CPU offload],
//                           flat_param/offload.h): offload = offload1 (master, gradient and
//                           optimizer state on the host), offload2 (the compute-dtype shard
//                           too), offload0 (off, overriding ShardingOptions::offload); with a
//                           strategy or recompute in any order ("keep+offload2:type=Block").
//                           The root takes ShardingOptions::offload.
//   gather  := 'gather_param' | 'gather_fp8' | 'gather_int8'
//                           the all-gathers' wire format of the rule's units
//                           (flat_param/quantized_gather.h), overriding
//                           MixedPrecision::gather_dtype; with the other options in any order
//                           ("keep+gather_fp8:type=Block"). The root takes MixedPrecision's.
//   term    := 'type'  '='  type  ('|' type)*    module type (see by_type in policy.h)
//            | 'size'  '>=' count                unclaimed parameter numel (by_size)
//            | 'path'  '='  glob  ('|' glob)*    module path glob (glob.h)
//            | 'every' '='  count                group the rule's matches k at a time, k >= 1
//                                                (at most once per rule, plus another term)
//   type    := ident ('::' ident)*               ident := [A-Za-z_][A-Za-z0-9_]*
//   glob    := one or more characters other than whitespace , ; |
//   count   := digits ['.' digits] [('e'|'E') ['+'|'-'] digits] ['k'|'K'|'m'|'M'|'g'|'G'|'b'|'B']
//              k = 1e3, M = 1e6, G = B = 1e9 (case-insensitive); the value must be a whole
//              number below 2^62: "1e7", "10000000", "10M", "1.5k" are all fine, "1.5" is not.
// Rules are tried in order; the first whose terms all match a module wins. Whitespace around
// tokens is ignored; an empty rule (";;", a trailing ';') and a trailing ',' are errors.
//
// Examples: "type=Block"  "every=2,type=Block"  "size>=1e7"  "type=Linear|LayerNorm|Embedding"
//           "noshard:path=lm_head;type=Block;root:grad_op"  "keep+recompute:type=Block"
//
// Errors throw c10::Error whose message names the column (1-based), the token, what was expected,
// and repeats the spec with a caret under the token:
//   policy spec: unknown key 'sise' at column 12 (expected one of: type, size, path, every)
//     type=Block;sise>=1e7
//                ^
#pragma once

#include <cstdint>
#include <string>

#include "wrap_policies/policy.h"

namespace flatshard {

Policy parse_policy(const std::string& spec);

// For grammars built on this one (the TP plan, wrap_policies/tp_plan.h), with their errors in
// the same form (column, token, expectation, caret) but starting "<label>:".
// parse_rule_terms: `term (',' term)*` (no every=K) from index `pos` of `spec` up to the next ';'
// or the end, where *end is left. Skips leading blanks.
Rule parse_rule_terms(const std::string& spec, size_t pos, size_t* end, const std::string& label);
// Throws the error at index `pos` of `spec`.
[[noreturn]] void spec_error(const std::string& spec, size_t pos, const std::string& what,
                             const std::string& expected, const std::string& label);

// A count as in the grammar above ("1.5k" -> 1500); throws c10::Error (without spec context)
// when malformed. Exposed for command-line flags that take sizes.
int64_t parse_count(const std::string& text);

}  // namespace flatshard

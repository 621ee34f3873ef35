// flatshard/planner/weights_tree.h — a checkpoint's tensors as a module tree on the meta device,
// read from the files' headers only, so any checkpoint can be planned and explained without
// building its model.
//
//   WeightsInfo w = read_weights("/models/Llama-3-70B", naming);  // headers only: ~ms
//   auto model = module_tree_from_weights(w, naming);              // meta parameters
//   auto plan = make_plan(*model, parse_policy(layer_list_policy(*find_layer_list(w))));
//   std::cout << explain(*model, plan, /*world_size=*/8, {}).to_string();
//
// `naming` (WeightsNaming, below) carries what a checkpoint's names mean in one family of
// layouts; the planner knows none (issue 31: no module-name literal below models/), so
// read_weights(path) and module_tree_from_weights(w) go by dtypes, shapes and plain name order
// alone, and models/hf_config.h's hf_naming() supplies the Hugging Face conventions.
//
// Contract — naming (WeightsNaming): three optional hooks, each unset by default.
//   * is_buffer(name): a floating-point tensor of a safetensors file (or index) that is a
//     buffer anyway (a rotary table a checkpoint saved). Unset: only the dtype decides. Not
//     asked for a flatshard checkpoint, whose manifest records its buffers.
//   * runs_last(top_level): the first component of a tensor name (a top-level module, or a
//     top-level tensor) runs after every other one (an output head). Unset: nothing is moved.
//   * module_type: Module::name() of each module of the tree (ModuleTypeFn). Unset:
//     generic_module_type.
//   Each hook must be a pure function of its argument (it may be called once per tensor or
//   module, in any order) and must not throw for a name it does not know.
//
// Contract — reading (read_weights):
//   * PATH is a safetensors file, a Hugging Face index (`*.safetensors.index.json`:
//     {"metadata": {...}, "weight_map": {tensor: file}}), a flatshard checkpoint's manifest.json,
//     or a directory holding one of them. A directory is tried in this order: manifest.json
//     (flatshard checkpoint), model.safetensors, model.safetensors.index.json (transformers'
//     order, Note [Weights file of a directory] in checkpoint/file_io.h), then the one
//     `*.safetensors.index.json` or the one `*.safetensors` it holds; anything else is an error
//     listing what was looked for.
//   * Only headers are read: the 8-byte length N and N bytes of JSON of a safetensors file,
//     validated by checkpoint/safetensors.h's parser (N <= 100 MB, strict depth-limited JSON,
//     known dtypes, shapes that do not overflow, data_offsets back to back and consistent with
//     shape x dtype, file size = 8 + N + data). Index and manifest JSON are read whole, at most
//     kMaxIndexBytes. Files are opened read-only with O_NONBLOCK (a FIFO cannot block the open)
//     and refused unless fstat calls them regular files. A symbolic link is followed only as
//     Note [Hub snapshots] (checkpoint/file_io.h) allows: from a hub-cache snapshot
//     (models--ORG--NAME/snapshots/REV/) to a regular file in that repository's blobs/; any
//     other link is refused, naming it and why. Shard files an index names must be plain names (no
//     '/', not "." or "..") and are resolved in the index's own directory; each distinct file's
//     header is read once, and every tensor of weight_map must be in its file's header (tensors a
//     header holds that weight_map does not list are left out and counted in `unlisted`).
//   * A flatshard checkpoint: checkpoint/manifest.h's parser (all of its checks) gives names,
//     dtypes, shapes and tied aliases; each file it lists must exist as a regular file of the
//     recorded size (its data is not read).
//   * Errors throw c10::Error with one line naming the file and what is wrong; names, paths and
//     values from the files are written through printable_escape() (support/input_file.h).
//   * Bounds (Note [Weights bounds], weights_tree.cpp): at most kMaxTensors tensors (module
//     objects are host memory: a clear error instead of gigabytes), counted in a safetensors
//     header before its JSON is parsed and over every header an index makes it read (listed in
//     weight_map or not); a tensor name has at most kMaxNameDepth dot-separated components (the
//     error names the tensor and the bound). Within them reading and the tree are linear in the
//     headers' size, and no walk over the tree recurses deeper than kMaxNameDepth.
//   * tensors are sorted in module order: the tensors whose top-level component
//     naming.runs_last accepts after all others, and within each group names compared
//     component by component, components that are numbers numerically ("layers.2" before
//     "layers.10"), numbers before names, the rest bytewise; a stable sort. With a naming that
//     moves the output head last, that is the order a forward runs for the usual layouts
//     (embeddings, layers, norm, head), which explain's prefetch simulation takes as the
//     execution order; without one, the head sorts among the other top-level modules.
//   * Buffers (not planned, not counted as parameters): a flatshard checkpoint's recorded
//     buffers; otherwise tensors whose dtype is not floating point and tensors that
//     naming.is_buffer accepts.
//
// Contract — the tree (module_tree_from_weights):
//   * Dotted prefixes are modules, the last component is the tensor's name in its module:
//     `model.layers.0.self_attn.q_proj.weight` is parameter `weight` of module
//     `model.layers.0.self_attn.q_proj`. Children are registered in module order (above), so
//     Plan's unit order follows it. A name with an empty component ("a..b", ".a"), or one that
//     is both a tensor and a module ("a.b" beside "a.b.c"), is an error naming both.
//   * Parameters are fp32 meta tensors of the recorded shapes (flatshard plans fp32 masters
//     whatever the file's dtype; WeightTensor::dtype keeps what the file holds), requires_grad
//     true; buffers keep their file dtype, also on meta. An alias {name, target} registers the
//     target's tensor (one TensorImpl) under `name` too, so Plan::tied and explain count it once.
//   * Module::name() (what a policy's type= matches, wrap_policies/policy.h) is what
//     naming.module_type (or `type_of`) returns for the module; generic_module_type() is the
//     default and looks at the parameters' shapes only, never at the module's path: a module
//     holding a 2-D parameter "weight" is "Linear", one holding only 1-D parameters and a
//     "weight" is "Norm", any other "Module". Those are guesses; a caller that knows the
//     layout passes its own (models/hf_config.h: "Embedding", the architecture's names).
//   * The tree can be planned, explained, costed and advised on (planner/explain.h,
//     cost_model.h, advisor.h); it has no forward and cannot be sharded for training.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace torch {
namespace nn {
class Module;
}
}  // namespace torch

namespace flatshard {

inline constexpr int64_t kMaxIndexBytes = int64_t{64} << 20;  // an index or manifest JSON
inline constexpr int64_t kMaxTensors = int64_t{1} << 19;      // DeepSeek-V3 has ~91k
// Components of a tensor name ("model.layers.0.mlp.up_proj.weight" has 6; Hugging Face
// checkpoints stay under ~12): the depth of the module tree, which walks recurse over.
inline constexpr int64_t kMaxNameDepth = 64;

struct WeightTensor {
  std::string name;                   // "model.layers.0.self_attn.q_proj.weight"
  at::ScalarType dtype = at::kFloat;  // as stored in the file
  std::vector<int64_t> shape;
  int64_t numel = 0;
  std::string file;     // the file holding it (a flatshard checkpoint: its first piece's)
  bool buffer = false;  // not planned (see the contract)
};

enum class WeightsFormat { kSafetensors, kSafetensorsIndex, kFlatshardCheckpoint };
const char* weights_format_name(WeightsFormat f);  // "safetensors", "safetensors index", ...

struct WeightsInfo {
  std::string path;  // the file read first (the index, the manifest or the safetensors file)
  std::string dir;   // its directory: where shard files and config.json are looked for
  WeightsFormat format = WeightsFormat::kSafetensors;
  std::vector<std::string> files;     // safetensors files whose headers were read
  std::vector<WeightTensor> tensors;  // module order (see the contract)
  // Tied names: {alias, target}; target is in `tensors`, alias is not.
  std::vector<std::pair<std::string, std::string>> aliases;
  int64_t unlisted = 0;  // tensors in shard headers that the index's weight_map leaves out

  const WeightTensor* find(const std::string& name) const;  // nullptr if absent
  int64_t num_parameters() const;  // elements of the non-buffer tensors (aliases counted once)
  // The parameters' file dtypes: "BF16", or "BF16 (722 tensors) + F32 (1)" when mixed.
  std::string dtype_summary() const;
  // `dir`/config.json when anything is there, else "" (a missing config.json is optional).
  // Whatever is there is read as the config (models/hf_config.h's read_hf_config), so a FIFO, a
  // dangling link or a link out of a hub snapshot is an error naming it, not a silent "none".
  std::string config_path() const;
};

// One module of the tree as the type namer sees it.
struct ModuleView {
  std::string path;  // "" for the root, "model.layers.0.mlp"
  std::string name;  // the last component ("mlp"; "" for the root)
  // Its own tensors (parameters and buffers) under their names in it ("weight"); an alias
  // appears under its own name with its target's WeightTensor.
  std::vector<std::pair<std::string, const WeightTensor*>> tensors;
  bool has_children = false;
};
using ModuleTypeFn = std::function<std::string(const ModuleView&)>;
std::string generic_module_type(const ModuleView& m);  // shapes only (the tree's contract)

// What a checkpoint's names mean (the naming contract above); {} knows no names.
struct WeightsNaming {
  std::function<bool(const std::string& name)> is_buffer;       // unset: the dtype decides
  std::function<bool(const std::string& top_level)> runs_last;  // unset: nothing moved last
  ModuleTypeFn module_type;                                     // unset: generic_module_type
};

WeightsInfo read_weights(const std::string& path, const WeightsNaming& naming = {});

// Registers `alias` as another name of tensor `target` (tied weights). Throws if target is
// missing or alias already names a tensor.
void add_alias(WeightsInfo& w, const std::string& alias, const std::string& target);

// A whole small file of a weights directory (config.json, an index), symbolic links followed
// only as read_weights follows them (Note [Hub snapshots]; a FIFO cannot block). Throws one line
// naming the file if it is missing, not a regular file, unreadable or larger than max_bytes.
std::string read_weights_text_file(const std::string& path, int64_t max_bytes);

// The tree named by naming.module_type (generic_module_type when unset), or by `type_of`.
std::shared_ptr<torch::nn::Module> module_tree_from_weights(const WeightsInfo& w,
                                                            const WeightsNaming& naming = {});
std::shared_ptr<torch::nn::Module> module_tree_from_weights(const WeightsInfo& w,
                                                            const ModuleTypeFn& type_of);

// A list of layers: modules <prefix>.0 .. <prefix>.<count - 1>, the children of <prefix>.
struct LayerList {
  std::string prefix;  // "model.layers"; "" when the root itself is the list
  int64_t count = 0;
};
// The module whose children are exactly 0 .. L-1 (numbers, no leading zeros, no gaps, nothing
// else) and that holds the most parameter elements (the outermost on a tie); nullopt if none.
std::optional<LayerList> find_layer_list(const WeightsInfo& w);
// The spec of one unit per layer: path globs matching "<prefix>.<N>" and nothing below it
// ("model.layers.[0-9]|model.layers.[0-9][0-9]": '*' would also match every module inside a
// layer, wrap_policies/glob.h). nullopt when the prefix holds glob or spec syntax characters.
std::optional<std::string> layer_list_policy(const LayerList& l);

}  // namespace flatshard

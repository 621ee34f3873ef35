// flatshard/models/families.cpp — families() of models/family.h: the one file that names every
// model family (a new family is one line here, docs/design.md). Apart from family.cpp so that no
// file pair in models/ includes each other (gpt.cpp and llama.cpp include family.h).
#include "models/family.h"
#include "models/gpt.h"
#include "models/llama.h"

namespace flatshard {
namespace models {

const std::vector<const Family*>& families() {
  static const std::vector<const Family*> all = {
      &gpt::GPTConfig::family(),
      &llama::LlamaConfig::family(),
  };
  return all;
}

}  // namespace models
}  // namespace flatshard

#include "collectives/mesh.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <sstream>

namespace flatshard {

namespace {
constexpr int index(MeshDim dim) { return static_cast<int>(dim); }
constexpr MeshDim kDims[kNumMeshDims] = {MeshDim::kReplicate, MeshDim::kShard, MeshDim::kTp};
}  // namespace

const char* to_string(MeshDim dim) {
  switch (dim) {
    case MeshDim::kReplicate: return "replicate";
    case MeshDim::kShard: return "shard";
    case MeshDim::kTp: return "tp";
  }
  return "?";
}

int MeshShape::global_size() const {
  int n = 1;
  for (int s : sizes) n *= s;
  return n;
}

std::string MeshShape::to_string() const {
  std::ostringstream os;
  const char* sep = "";
  for (MeshDim d : kDims) {
    if (size(d) == 1 && d != MeshDim::kShard) continue;
    os << sep << flatshard::to_string(d) << ' ' << size(d);
    sep = " x ";
  }
  return os.str();
}

Mesh::Mesh(Communicator& shard, Communicator* replicate) {
  groups_[index(MeshDim::kShard)] = &shard;
  groups_[index(MeshDim::kReplicate)] = replicate;
}

Mesh::Mesh(Communicator& shard, Communicator* replicate, Communicator* tp) : Mesh(shard, replicate) {
  groups_[index(MeshDim::kTp)] = tp;
}

Communicator& Mesh::shard() const {
  Communicator* c = groups_[index(MeshDim::kShard)];
  TORCH_CHECK(c != nullptr, "Mesh: the shard-group communicator is null");
  return *c;
}

Communicator* Mesh::group(MeshDim dim) const {
  Communicator* c = groups_[index(dim)];
  return c != nullptr && c->world_size() > 1 ? c : nullptr;
}

int Mesh::size(MeshDim dim) const {
  const Communicator* c = groups_[index(dim)];
  return c ? c->world_size() : 1;
}

int Mesh::coord(MeshDim dim) const {
  const Communicator* c = groups_[index(dim)];
  return c ? c->rank() : 0;
}

MeshShape Mesh::shape() const {
  MeshShape s;
  for (MeshDim d : kDims) s.sizes[index(d)] = size(d);
  return s;
}

int Mesh::global_rank() const { return global_rank_at(MeshDim::kShard, coord(MeshDim::kShard)); }

int Mesh::global_rank_at(MeshDim dim, int i) const {
  int r = 0;
  for (MeshDim d : kDims) r = r * size(d) + (d == dim ? i : coord(d));
  return r;
}

bool Mesh::first_along_others(MeshDim dim) const {
  for (MeshDim d : kDims)
    if (d != dim && coord(d) != 0) return false;
  return true;
}

void Mesh::check() const {
  Communicator& s = shard();
  for (MeshDim d : kDims) {
    const Communicator* c = groups_[index(d)];
    if (c == nullptr || c == &s) continue;
    TORCH_CHECK(c->device() == s.device(), "Mesh (", describe_rank(), "): the shard group works on ",
                s.device(), " but the ", to_string(d), " group on ", c->device());
  }
}

void all_reduce(const Mesh& mesh, const at::Tensor& tensor, ReduceOp op, c10::Stream stream) {
  for (int i = kNumMeshDims - 1; i >= 0; --i)
    if (Communicator* c = mesh.group(kDims[i])) c->all_reduce(tensor, op, stream);
}

void Mesh::reset_counters() const {
  for (Communicator* c : groups_)
    if (c) c->reset_counters();
}

std::string Mesh::describe_rank() const {
  std::ostringstream os;
  os << "rank " << global_rank() << " (";
  const char* sep = "";
  for (MeshDim d : kDims) {
    if (groups_[index(d)] == nullptr) continue;
    os << sep << to_string(d) << ' ' << coord(d) << " of " << size(d);
    sep = ", ";
  }
  os << ')';
  return os.str();
}

}  // namespace flatshard

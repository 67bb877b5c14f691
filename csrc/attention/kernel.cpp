#include "attention/kernel.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <climits>
#include <limits>
#include <map>
#include <mutex>
#include <stdexcept>
#include <utility>

#include "attention/block_attention.h"
#include "common/env.h"

namespace bytescale {
namespace attention {

std::optional<std::tuple<at::Tensor, at::Tensor>> BlockKernel::attend(const at::Tensor& q,
                                                                      const at::Tensor& k,
                                                                      const at::Tensor& v,
                                                                      const BlockPair& bp,
                                                                      double scale) const {
  const auto acc = accType(q.scalar_type());
  at::Tensor out = at::zeros({q.size(0), q.size(1), q.size(2)}, q.options().dtype(acc));
  at::Tensor lse = at::full({q.size(1), q.size(0)}, -std::numeric_limits<double>::infinity(),
                            q.options().dtype(acc));
  if (!forward(q, k, v, bp, scale, out, lse)) return std::nullopt;
  return std::make_tuple(out.to(q.scalar_type()), lse);
}

namespace {

// The tiled kernel (block_attention.h): ATen ops on any device, the fallback of every step.
class TiledKernel final : public BlockKernel {
 public:
  std::string name() const override { return "tiled"; }
  int rank() const override { return 0; }
  bool availableOn(const c10::Device&) const override { return true; }
  bool accepts(const at::Tensor&, const BlockPair&) const override { return true; }

  bool forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const BlockPair& bp,
               double scale, at::Tensor& out, at::Tensor& lse) const override {
    auto [ob, lb] = blockForward(q, k, v, bp.queryMeta(), bp.keyMeta(), bp.causal, scale);
    mergeInto(out, lse, ob, lb);
    return true;
  }

  std::optional<std::tuple<at::Tensor, at::Tensor>> attend(const at::Tensor& q, const at::Tensor& k,
                                                           const at::Tensor& v, const BlockPair& bp,
                                                           double scale) const override {
    auto [ob, lb] = blockForward(q, k, v, bp.queryMeta(), bp.keyMeta(), bp.causal, scale);
    return std::make_tuple(ob.to(q.scalar_type()), lb);
  }

  bool backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                at::Tensor& delta, const BlockPair& bp, double scale, at::Tensor& dq,
                at::Tensor& dk, at::Tensor& dv) const override {
    if (!delta.defined()) {
      const auto acc = accType(out.scalar_type());
      delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(0, 1).contiguous();
    }
    auto [dqb, dkb, dvb] = blockBackward(dout, q, k, v, lse, delta, bp.queryMeta(), bp.keyMeta(),
                                         bp.causal, scale);
    dq.add_(dqb);
    dk.add_(dkb);
    dv.add_(dvb);
    return true;
  }
};

// A kernel available on one device, with whether "auto" may pick it there.
struct Candidate {
  const BlockKernel* kernel;
  bool preferred;
};

struct Registry {
  std::mutex mu;
  std::map<c10::DeviceType, std::vector<std::shared_ptr<const BlockKernel>>> by_type;
  // Per device (type, index): the candidates, highest rank first. Built on first use.
  std::map<std::pair<c10::DeviceType, c10::DeviceIndex>, std::vector<Candidate>> by_device;
  // The kernel choice; BYTESCALE_ATTENTION_KERNEL on first use (not at load: a bad value then
  // raises from the first attention op, not from a static initialiser).
  std::optional<std::string> choice;

  const std::string& currentChoice() {
    if (!choice) choice = env::knobs().attention_kernel;
    return *choice;
  }
};

// Never destroyed: plug-ins register from static initialisers of the same library, and steps
// may run while other statics are torn down at exit.
Registry& registry() {
  static auto* r = new Registry();
  return *r;
}

const TiledKernel& tiled() {
  static const auto* k = new TiledKernel();
  return *k;
}

}  // namespace

const BlockKernel& tiledKernel() { return tiled(); }

void registerKernel(c10::DeviceType device, std::shared_ptr<const BlockKernel> kernel) {
  if (!kernel) throw std::invalid_argument("bytescale attention: registering a null kernel");
  if (kernel->rank() <= 0)
    throw std::invalid_argument("bytescale attention: kernel " + kernel->name() +
                                " needs a rank above the tiled kernel's 0");
  auto& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  for (const auto& [type, list] : r.by_type)
    for (const auto& k : list)
      if (k->name() == kernel->name())
        throw std::invalid_argument("bytescale attention: a kernel named " + kernel->name() +
                                    " is already registered");
  auto& list = r.by_type[device];
  list.push_back(std::move(kernel));
  std::stable_sort(list.begin(), list.end(),
                   [](const auto& a, const auto& b) { return a->rank() > b->rank(); });
  r.by_device.clear();
}

const BlockKernel* findKernel(const std::string& name) {
  if (name == "tiled") return &tiled();
  auto& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  for (const auto& [type, list] : r.by_type)
    for (const auto& k : list)
      if (k->name() == name) return k.get();
  return nullptr;
}

std::vector<std::string> kernelNames(c10::DeviceType device) {
  auto& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  std::vector<std::string> names;
  auto it = r.by_type.find(device);
  if (it != r.by_type.end())
    for (const auto& k : it->second) names.push_back(k->name());
  return names;
}

std::string kernelChoice() {
  auto& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  return r.currentChoice();
}

void setKernelChoice(const std::string& choice) {
  env::checkAttentionKernel(choice);
  auto& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  r.choice = choice;
}

const BlockKernel& chooseKernel(const at::Tensor& q, const BlockPair& bp, const BlockKernel* below) {
  std::vector<Candidate> cands;
  int cap = below ? below->rank() - 1 : INT_MAX;
  bool forced = false;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> g(r.mu);
    const std::string& choice = r.currentChoice();  // read (and checked) on every device
    const c10::Device dev = q.device();
    auto key = std::make_pair(dev.type(), dev.has_index() ? dev.index() : c10::DeviceIndex(-1));
    auto it = r.by_device.find(key);
    if (it == r.by_device.end()) {
      std::vector<Candidate> list;
      auto t = r.by_type.find(dev.type());
      if (t != r.by_type.end())
        for (const auto& k : t->second)
          if (k->availableOn(dev)) list.push_back({k.get(), k->prefersDevice(dev)});
      it = r.by_device.emplace(key, std::move(list)).first;
    }
    if (it->second.empty()) return tiled();
    cands = it->second;
    if (choice != "auto") {
      forced = true;
      int named = 0;  // a name no kernel here has: tiled only
      for (const auto& c : cands)
        if (c.kernel->name() == choice) named = c.kernel->rank();
      cap = std::min(cap, named);
    }
  }
  for (const auto& c : cands)
    if (c.kernel->rank() <= cap && (forced || c.preferred) && c.kernel->accepts(q, bp))
      return *c.kernel;
  return tiled();
}

}  // namespace attention
}  // namespace bytescale

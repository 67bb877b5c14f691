// Internal to the planner: best-fit bin packing of whole sequences into capacity-sized local
// micro-batches, the one packing the strategies share (naive / pow2 in strategies.cpp, the plan
// builder's packLocal, PP-Balance's and pp-lockstep's bins in pp_layout.cpp). Pure C++, no torch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

namespace bytescale {
namespace planner {
namespace detail {

// Packs sequences seqs[0 .. n) (indices into len; the caller orders them, longest first for best
// fit decreasing) in that order: each goes to the open bin with the least room (cap - fill) that
// still holds it, else to a new bin; a sequence longer than cap gets a bin of its own. Ties between
// bins of equal room: with n <= linear_upto, the lowest-numbered bin (a scan); otherwise the bin
// whose room was set first (an ordered multimap). bins[k]: bin k's sequences in packing order
// (bins numbered as opened); fill[k]: its tokens.
inline void packBestFit(const std::vector<int64_t>& len, const int64_t* seqs, size_t n, int64_t cap,
                        size_t linear_upto, std::vector<std::vector<int64_t>>& bins,
                        std::vector<int64_t>& fill) {
  bins.clear();
  fill.clear();
  const bool scan = n <= linear_upto;
  std::multimap<int64_t, size_t> room;  // cap - fill of the bins with room left (the map's path)
  for (size_t k = 0; k < n; ++k) {
    const int64_t s = len[seqs[k]];
    size_t idx = bins.size();
    if (scan) {
      for (size_t j = 0; j < bins.size(); ++j)
        if (cap - fill[j] >= s && (idx == bins.size() || cap - fill[j] < cap - fill[idx])) idx = j;
    } else {
      auto it = room.lower_bound(s);
      if (it != room.end()) {
        idx = it->second;
        room.erase(it);
      }
    }
    if (idx == bins.size()) {
      bins.emplace_back();
      fill.push_back(0);
    }
    bins[idx].push_back(seqs[k]);
    fill[idx] += s;
    if (!scan && cap - fill[idx] > 0) room.emplace(cap - fill[idx], idx);
  }
}

}  // namespace detail
}  // namespace planner
}  // namespace bytescale

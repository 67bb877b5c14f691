// Row gather / scatter-add through segment tables and the log-sum-exp merge (kernels.h).
// All three are memory-bound: each moves every byte once, in 16-byte vectors where the rows allow
// (gather) or with consecutive lanes on consecutive elements (merge, scatter-add).
#include "cuda/attention/kernels.h"

#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

namespace bytescale {
namespace cuda {

namespace {

constexpr int kThreads = 256;

// Big-tensor row of packed row r (identity without a table). Binary search over the segments'
// packed starts; tables are small (one segment per document) and stay in L1.
__device__ __forceinline__ int64_t mapRow(const int32_t* table, int nseg, int64_t r) {
  if (table == nullptr) return r;
  int lo = 0, hi = nseg - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (table[3 * mid] <= r) lo = mid; else hi = mid - 1;
  }
  return static_cast<int64_t>(table[3 * lo + 1]) + (r - table[3 * lo]);
}

template <typename V>
__global__ void gatherKernel(const V* __restrict__ src, V* __restrict__ dst, const int32_t* table,
                             int nseg, int64_t outer, int64_t rows, int64_t big_rows, int64_t vecs) {
  const int64_t total = outer * rows * vecs;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = i % vecs;
    const int64_t r = (i / vecs) % rows;
    const int64_t o = i / (vecs * rows);
    dst[i] = src[(o * big_rows + mapRow(table, nseg, r)) * vecs + c];
  }
}

template <typename T>
__global__ void scatterAddKernel(float* __restrict__ acc, const T* __restrict__ src,
                                 const int32_t* table, int nseg, int64_t rows, int64_t width) {
  const int64_t total = rows * width;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / width, c = i % width;
    acc[mapRow(table, nseg, r) * width + c] += static_cast<float>(src[i]);
  }
}

// One warp per (block row, head).
template <typename T>
__global__ void mergeKernel(float* __restrict__ out, float* __restrict__ lse,
                            const T* __restrict__ out_b, const float* __restrict__ lse_b,
                            const int32_t* table, int nseg, int64_t rows, int64_t big_rows,
                            int64_t heads, int64_t dim) {
  const int64_t warp = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= rows * heads) return;
  const int64_t r = warp / heads, h = warp % heads;
  const float lb = lse_b[h * rows + r];
  if (!(lb > -INFINITY && lb < INFINITY)) return;  // the block gave this row nothing
  const int64_t t = mapRow(table, nseg, r);
  const float la = lse[h * big_rows + t];
  const float m = fmaxf(la, lb);
  const float nl = m + logf(expf(la - m) + expf(lb - m));
  const float wa = expf(la - nl), wb = expf(lb - nl);
  float* o = out + (t * heads + h) * dim;
  const T* ob = out_b + (r * heads + h) * dim;
  for (int64_t c = lane; c < dim; c += 32) o[c] = wa * o[c] + wb * static_cast<float>(ob[c]);
  __syncwarp();
  if (lane == 0) lse[h * big_rows + t] = nl;
}

int numBlocks(int64_t threads) {
  const int64_t b = (threads + kThreads - 1) / kThreads;
  return static_cast<int>(std::min<int64_t>(std::max<int64_t>(b, 1), INT32_MAX));
}

const int32_t* tablePtr(const at::Tensor& table, int& nseg) {
  if (!table.defined()) {
    nseg = 0;
    return nullptr;
  }
  TORCH_CHECK(table.scalar_type() == at::kInt && table.dim() == 2 && table.size(1) == 3 &&
                  table.is_contiguous() && table.is_cuda(),
              "bytescale: internal error, bad row table ", table.sizes());
  nseg = static_cast<int>(table.size(0));
  TORCH_CHECK(nseg > 0, "bytescale: internal error, empty row table");
  return table.data_ptr<int32_t>();
}

template <typename V>
void launchGather(const at::Tensor& src, at::Tensor& dst, const int32_t* tp, int nseg, int64_t outer,
                  int64_t rows, int64_t big_rows, int64_t row_bytes) {
  const int64_t vecs = row_bytes / static_cast<int64_t>(sizeof(V));
  gatherKernel<V><<<numBlocks(outer * rows * vecs), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      static_cast<const V*>(src.const_data_ptr()), static_cast<V*>(dst.data_ptr()), tp, nseg, outer,
      rows, big_rows, vecs);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool aligned(const at::Tensor& t, size_t n) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % n == 0;
}

}  // namespace

void gatherRows(const at::Tensor& src, at::Tensor& dst, const at::Tensor& table, int64_t row_dim) {
  TORCH_CHECK(src.is_contiguous() && dst.is_contiguous() && src.scalar_type() == dst.scalar_type() &&
                  src.dim() == dst.dim() && row_dim < src.dim(),
              "bytescale gatherRows: internal error, src ", src.sizes(), " dst ", dst.sizes());
  const c10::cuda::CUDAGuard guard(src.device());
  int nseg = 0;
  const int32_t* tp = tablePtr(table, nseg);
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < row_dim; ++d) outer *= src.size(d);
  for (int64_t d = row_dim + 1; d < src.dim(); ++d) inner *= src.size(d);
  const int64_t rows = dst.size(row_dim), big_rows = src.size(row_dim);
  if (outer * rows * inner == 0) return;
  const int64_t row_bytes = inner * static_cast<int64_t>(src.element_size());
  auto fits = [&](size_t n) { return row_bytes % n == 0 && aligned(src, n) && aligned(dst, n); };
  if (fits(16)) launchGather<uint4>(src, dst, tp, nseg, outer, rows, big_rows, row_bytes);
  else if (fits(8)) launchGather<uint2>(src, dst, tp, nseg, outer, rows, big_rows, row_bytes);
  else if (fits(4)) launchGather<uint32_t>(src, dst, tp, nseg, outer, rows, big_rows, row_bytes);
  else if (fits(2)) launchGather<uint16_t>(src, dst, tp, nseg, outer, rows, big_rows, row_bytes);
  else launchGather<uint8_t>(src, dst, tp, nseg, outer, rows, big_rows, row_bytes);
}

void scatterAddRows(at::Tensor& acc, const at::Tensor& src, const at::Tensor& table) {
  TORCH_CHECK(acc.scalar_type() == at::kFloat && acc.is_contiguous() && src.is_contiguous() &&
                  acc.dim() == src.dim() && acc.numel() / std::max<int64_t>(acc.size(0), 1) ==
                  src.numel() / std::max<int64_t>(src.size(0), 1),
              "bytescale scatterAddRows: internal error, acc ", acc.sizes(), " ", acc.scalar_type(),
              " src ", src.sizes());
  const c10::cuda::CUDAGuard guard(acc.device());
  int nseg = 0;
  const int32_t* tp = tablePtr(table, nseg);
  const int64_t rows = src.size(0), width = src.numel() / std::max<int64_t>(rows, 1);
  if (rows * width == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "bytescale_scatter_add", [&] {
    scatterAddKernel<scalar_t><<<numBlocks(rows * width), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        acc.data_ptr<float>(), src.const_data_ptr<scalar_t>(), tp, nseg, rows, width);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void mergeLse(at::Tensor& out, at::Tensor& lse, const at::Tensor& out_b, const at::Tensor& lse_b,
              const at::Tensor& table) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && lse.scalar_type() == at::kFloat &&
                  lse_b.scalar_type() == at::kFloat && out.is_contiguous() && lse.is_contiguous() &&
                  out_b.is_contiguous() && lse_b.is_contiguous() && out.dim() == 3 &&
                  out_b.dim() == 3 && out.size(1) == out_b.size(1) && out.size(2) == out_b.size(2) &&
                  lse_b.size(0) == out_b.size(1) && lse_b.size(1) == out_b.size(0),
              "bytescale mergeLse: internal error, out ", out.sizes(), " lse ", lse.sizes(),
              " out_b ", out_b.sizes(), " lse_b ", lse_b.sizes());
  const c10::cuda::CUDAGuard guard(out.device());
  int nseg = 0;
  const int32_t* tp = tablePtr(table, nseg);
  const int64_t rows = out_b.size(0), heads = out.size(1), dim = out.size(2);
  if (rows * heads == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_b.scalar_type(), "bytescale_merge_lse", [&] {
    mergeKernel<scalar_t><<<numBlocks(rows * heads * 32), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        out.data_ptr<float>(), lse.data_ptr<float>(), out_b.const_data_ptr<scalar_t>(),
        lse_b.const_data_ptr<float>(), tp, nseg, rows, out.size(0), heads, dim);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

int computeCapabilityMajor(const c10::Device& device) {
  if (!device.is_cuda()) return 0;
  const int index = device.has_index() ? device.index() : c10::cuda::current_device();
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return major;
}

}  // namespace cuda
}  // namespace bytescale

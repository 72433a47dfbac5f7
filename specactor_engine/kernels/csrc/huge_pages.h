// Weights packed on 2 MB pages: shared by the packed-linear kernels (bf16_linear.cpp, int8_linear.cpp).
#pragma once

#include <torch/extension.h>

#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace specactor {

// The packed weight lives in its own mapping, aligned to 2 MB and advised onto huge pages before it is first
// written (transparent huge pages in "madvise" mode serve only regions that ask, and memory the allocator
// recycles was faulted in small pages already). Streaming a weight through 4 KB pages takes a TLB walk every
// 4 KB and stops the prefetchers at every page end: with 2 MB pages the 55 MB gate/up weight of Qwen2.5-1.5B took
// 0.68 ms a 4-row call against 0.92 (bench/session39/README.md). Where the system refuses, the mapping keeps small
// pages and nothing else changes.
inline at::Tensor empty_on_huge_pages(at::IntArrayRef sizes, const at::TensorOptions& options) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr size_t HUGE = size_t(1) << 21;
  size_t bytes = options.dtype().itemsize();
  for (const int64_t size : sizes) bytes *= static_cast<size_t>(size);
  if (bytes >= HUGE) {
    const size_t mapped = (bytes + 2 * HUGE - 1) & ~(HUGE - 1);  // room to align the start to 2 MB
    void* base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base != MAP_FAILED) {
      const uintptr_t start = (reinterpret_cast<uintptr_t>(base) + HUGE - 1) & ~uintptr_t(HUGE - 1);
      madvise(reinterpret_cast<void*>(start), bytes, MADV_HUGEPAGE);
      return torch::from_blob(reinterpret_cast<void*>(start), sizes,
                              [base, mapped](void*) { munmap(base, mapped); }, options);
    }
  }
#endif
  return at::empty(sizes, options);
}

}  // namespace specactor

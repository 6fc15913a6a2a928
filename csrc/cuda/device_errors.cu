// Torch glue of jakiro::device_errors: the device's error word (DeviceError bits, cuda/device.h),
// read and cleared in stream order (no synchronisation: the caller reads the copy when it
// synchronises anyway).
#include <map>
#include <mutex>

#include "cuda/launch.h"
#include "ops.h"

namespace jakiro::gpu {

int32_t* error_word(const at::Tensor& like) {
  static std::mutex mutex;
  // Never freed: kernels in flight (or in a captured graph) may still write a word at exit.
  static auto* words = new std::map<int, at::Tensor>();
  const std::lock_guard<std::mutex> lock(mutex);
  const int index = like.device().is_cpu() ? -1 : like.device().index();
  at::Tensor& word = (*words)[index];
  if (!word.defined()) word = at::zeros({1}, like.options().dtype(at::kInt));
  return word.data_ptr<int32_t>();
}

namespace {

at::Tensor device_errors_gpu(const at::Tensor& like) {
  const DeviceScope scope(like);
  const at::Tensor word = at::from_blob(error_word(like), {1}, like.options().dtype(at::kInt));
  at::Tensor out = word.clone();
  word.zero_();
  return out;
}

}  // namespace

JAKIRO_GPU_LIBRARY_IMPL(m) { m.impl("device_errors", &device_errors_gpu); }

}  // namespace jakiro::gpu

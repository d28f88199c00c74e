// Host-side services shared by the CUDA ops (runtime.h), and the backend's
// answer to "is there a CUDA device?".
#include "cuda/runtime.h"

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "backends.h"

#ifndef ATTNRES_CUDA_ARCHS
#define ATTNRES_CUDA_ARCHS "unknown"
#endif

namespace attnres {
namespace cuda {
namespace {

std::string Hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%p", p);
  return buf;
}

std::string Versions() {
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  return "driver API " + std::to_string(driver) + ", attnres built with runtime " +
         std::to_string(runtime) + " for architectures " + ATTNRES_CUDA_ARCHS;
}

// The library's memory pool of each device, created on first use and never
// destroyed (tearing it down at exit could race the driver's own teardown).
cudaError_t DevicePool(int device, cudaMemPool_t* pool) {
  static std::mutex mutex;
  static std::vector<cudaMemPool_t> pools;
  std::lock_guard<std::mutex> lock(mutex);
  if (static_cast<size_t>(device) >= pools.size()) pools.resize(device + 1, nullptr);
  if (pools[device] == nullptr) {
    int supported = 0;
    cudaError_t err = cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device);
    if (err != cudaSuccess) return err;
    if (!supported) return cudaErrorNotSupported;
    cudaMemPoolProps props = {};
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypeNone;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    cudaMemPool_t created = nullptr;
    if ((err = cudaMemPoolCreate(&created, &props)) != cudaSuccess) return err;
    uint64_t keep = kPoolKeepBytes;
    if ((err = cudaMemPoolSetAttribute(created, cudaMemPoolAttrReleaseThreshold, &keep)) !=
        cudaSuccess) {
      cudaMemPoolDestroy(created);
      return err;
    }
    pools[device] = created;
  }
  *pool = pools[device];
  return cudaSuccess;
}

// Up to this many pointers travel in one WritePointersKernel launch (2 KiB of
// parameters).
constexpr int kPointersPerLaunch = 256;
struct PointerBatch {
  const void* ptrs[kPointersPerLaunch];
  const void** dst;
  int count;
};

__global__ void __launch_bounds__(kPointersPerLaunch)
    WritePointersKernel(const __grid_constant__ PointerBatch batch) {
  if (static_cast<int>(threadIdx.x) < batch.count) batch.dst[threadIdx.x] = batch.ptrs[threadIdx.x];
}

}  // namespace

attnres_status CudaFailure(const std::string& what, cudaError_t err) {
  attnres_status status = ATTNRES_ERROR_DEVICE_FAILURE;
  std::string hint;
  switch (err) {
    case cudaErrorMemoryAllocation:
      status = ATTNRES_ERROR_OUT_OF_MEMORY;
      break;
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorUnsupportedPtxVersion:
    case cudaErrorInsufficientDriver:
    case cudaErrorNotSupported:
      status = ATTNRES_ERROR_UNSUPPORTED_DEVICE;
      hint = " [" + Versions() + "]";
      break;
    default:
      break;
  }
  return Fail(status, "attnres CUDA backend: " + what + " failed: " + cudaGetErrorName(err) +
                          " (" + cudaGetErrorString(err) + ")" + hint);
}

attnres_status CheckLaunch(const std::string& kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return ATTNRES_OK;
  return CudaFailure("launch of " + kernel, err);
}

attnres_status CurrentDevice(cudaStream_t stream, Device* device) {
  cudaError_t err = cudaGetDevice(&device->id);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return CudaFailure("cudaGetDevice", err);
  }
  err = cudaDeviceGetAttribute(&device->num_sms, cudaDevAttrMultiProcessorCount, device->id);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return CudaFailure("cudaDeviceGetAttribute(multiProcessorCount)", err);
  }
  int optin = 0;
  err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device->id);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return CudaFailure("cudaDeviceGetAttribute(maxSharedMemoryPerBlockOptin)", err);
  }
  device->max_shared_optin = static_cast<size_t>(optin);
#if CUDART_VERSION >= 12080
  // While the stream is being captured into a graph, CUDA refuses to name its device
  // (cudaErrorStreamCaptureUnsupported, seen on an H200 with CUDA 13.0) and the refused
  // call can end the capture. So during a capture this check is left out (the pointer
  // checks below still run).
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  err = cudaStreamIsCapturing(stream, &capture);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return CudaFailure("cudaStreamIsCapturing of params.stream", err);
  }
  if (capture != cudaStreamCaptureStatusNone) return ATTNRES_OK;
  int stream_device = -1;
  err = cudaStreamGetDevice(stream, &stream_device);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return CudaFailure("cudaStreamGetDevice of params.stream", err);
  }
  if (stream_device != device->id) {
    return Fail(ATTNRES_ERROR_INVALID_ARGUMENT,
                "attnres CUDA backend: stream belongs to CUDA device " +
                    std::to_string(stream_device) + ", but the current device is " +
                    std::to_string(device->id) +
                    " (attnres runs on the current device: make the tensors' device current)");
  }
#else
  (void)stream;
#endif
  return ATTNRES_OK;
}

attnres_status CheckDevicePointer(const void* ptr, const std::string& name, const Device& device) {
  if (ptr == nullptr) return ATTNRES_OK;
  cudaPointerAttributes attr = {};
  const cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return CudaFailure("cudaPointerGetAttributes of " + name, err);
  }
  const std::string where = "attnres CUDA backend: " + name + " (" + Hex(ptr) + ") ";
  const std::string wanted = "device = CUDA needs memory of the current CUDA device, " +
                             std::to_string(device.id);
  switch (attr.type) {
    case cudaMemoryTypeDevice:
      if (attr.device == device.id) return ATTNRES_OK;
      return Fail(ATTNRES_ERROR_INVALID_ARGUMENT,
                  where + "is memory of CUDA device " + std::to_string(attr.device) + "; " +
                      wanted + " (make the tensors' device current)");
    case cudaMemoryTypeManaged:
      return ATTNRES_OK;
    case cudaMemoryTypeHost:
      return Fail(ATTNRES_ERROR_INVALID_ARGUMENT, where + "is page-locked host memory; " + wanted);
    default:
      return Fail(ATTNRES_ERROR_INVALID_ARGUMENT,
                  where + "is not memory allocated through CUDA (pageable host memory?); " +
                      wanted);
  }
}

Scratch::~Scratch() {
  // A failure here is the context's sticky error, which the next call reports.
  if (ptr_ != nullptr && cudaFreeAsync(ptr_, stream_) != cudaSuccess) cudaGetLastError();
}

attnres_status Scratch::Allocate(size_t bytes, const std::string& what) {
  cudaMemPool_t pool = nullptr;
  cudaError_t err = DevicePool(device_.id, &pool);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return CudaFailure("creating the scratch memory pool of device " + std::to_string(device_.id),
                       err);
  }
  err = cudaMallocFromPoolAsync(&ptr_, std::max<size_t>(bytes, 1), pool, stream_);
  if (err == cudaSuccess) return ATTNRES_OK;
  ptr_ = nullptr;
  cudaGetLastError();  // allocation errors are not sticky: clear them
  return CudaFailure("cudaMallocFromPoolAsync of " + std::to_string(bytes) + " bytes for " + what,
                     err);
}

attnres_status WritePointerTable(const void* const* ptrs, int64_t n, cudaStream_t stream,
                                 const void** table) {
  for (int64_t first = 0; first < n; first += kPointersPerLaunch) {
    PointerBatch batch = {};
    batch.count = static_cast<int>(std::min<int64_t>(kPointersPerLaunch, n - first));
    std::copy(ptrs + first, ptrs + first + batch.count, batch.ptrs);
    batch.dst = table + first;
    WritePointersKernel<<<1, kPointersPerLaunch, 0, stream>>>(batch);
    if (attnres_status s = CheckLaunch("WritePointersKernel"); s != ATTNRES_OK) return s;
  }
  return ATTNRES_OK;
}

attnres_status GridCap(int64_t* cap) {
  *cap = 0;
  const char* text = std::getenv("ATTNRES_CUDA_MAX_CTAS");
  if (text == nullptr || *text == '\0') return ATTNRES_OK;
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);  // NOLINT(runtime/int)
  if (*end != '\0' || value <= 0) {
    return Fail(ATTNRES_ERROR_INVALID_ARGUMENT,
                std::string("attnres CUDA backend: ATTNRES_CUDA_MAX_CTAS (a test knob that caps "
                            "every grid) must be a positive integer, got '") +
                    text + "'");
  }
  *cap = value;
  return ATTNRES_OK;
}

attnres_status PipelineKnob(bool backward, bool* on) {
  const char* name = backward ? "ATTNRES_CUDA_BACKWARD_PIPELINE" : "ATTNRES_CUDA_FORWARD_PIPELINE";
  const char* text = std::getenv(name);
  const std::string value = text == nullptr ? "" : text;
  *on = value == "1";
  if (value.empty() || value == "0" || value == "1") return ATTNRES_OK;
  return Fail(ATTNRES_ERROR_INVALID_ARGUMENT,
              std::string("attnres CUDA backend: ") + name + " must be 0 or 1, got '" + value + "'");
}

attnres_status CheckKernel(const void* kernel, int threads, const std::string& name) {
  cudaFuncAttributes attr = {};
  const cudaError_t err = cudaFuncGetAttributes(&attr, kernel);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return CudaFailure("cudaFuncGetAttributes of " + name, err);
  }
  if (attr.maxThreadsPerBlock < threads) {
    return Fail(ATTNRES_ERROR_INTERNAL,
                "attnres CUDA backend: " + name + " runs at most " +
                    std::to_string(attr.maxThreadsPerBlock) + " threads per CTA, the plan needs " +
                    std::to_string(threads) + " (plan.h's shapes and the launch bounds disagree)");
  }
  return ATTNRES_OK;
}

attnres_status AllowSharedMemory(const void* kernel, size_t dynamic_smem, const std::string& name,
                                 const Device& device, bool* fits) {
  *fits = true;
  cudaFuncAttributes attr = {};
  cudaError_t err = cudaFuncGetAttributes(&attr, kernel);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return CudaFailure("cudaFuncGetAttributes of " + name, err);
  }
  // The 48 KiB a kernel gets without opting in are static and dynamic shared
  // memory together: the forward's 512 B of reduction slots count too.
  if (dynamic_smem + attr.sharedSizeBytes <= plan::kDefaultSharedBytes) return ATTNRES_OK;
  const size_t limit = device.max_shared_optin > attr.sharedSizeBytes
                           ? device.max_shared_optin - attr.sharedSizeBytes
                           : 0;
  if (dynamic_smem > limit) {
    *fits = false;
    return ATTNRES_OK;
  }
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(limit));
  if (err != cudaSuccess) {
    cudaGetLastError();
    return CudaFailure("allowing " + name + " " + std::to_string(limit) +
                           " bytes of dynamic shared memory (cudaFuncSetAttribute)",
                       err);
  }
  return ATTNRES_OK;
}

}  // namespace cuda

// A driver that reports no device, or no driver at all (cudaDriverGetVersion
// gives 0), means "no CUDA here". Any other failure means a GPU and a driver
// exist but cannot be used (a driver older than the runtime attnres was built
// with, a device in exclusive use, a broken install): then the device counts as
// present, so that calls fail with the CUDA error's text instead of every
// caller and test silently taking the "no device" path.
bool CudaAvailable() {
  static const bool available = [] {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err == cudaSuccess) return count > 0;
    cudaGetLastError();
    int driver = 0;
    const bool has_driver = cudaDriverGetVersion(&driver) == cudaSuccess && driver > 0;
    cudaGetLastError();
    return err != cudaErrorNoDevice && err != cudaErrorStubLibrary && has_driver;
  }();
  return available;
}

}  // namespace attnres

/* A libcuda.so.1 that launches nothing, for measuring and testing the host side of kernel launches
 * without a GPU (tests/null_cuda.py): Triton's own CUDA driver module (driver.c, its C launcher)
 * links against it; every call succeeds with the figures of an H100/H200 (sm_90, 132 SMs, 227 KB
 * of shared memory per block); cuLaunchKernelEx counts the launch and keeps its grid. */
#include <cuda.h>
#include <string.h>

static unsigned long long launches;
static unsigned int last_grid[3];

unsigned long long gjit_null_launches(void) { return launches; }
void gjit_null_last_grid(unsigned int *out) { memcpy(out, last_grid, sizeof(last_grid)); }

CUresult cuInit(unsigned int flags) { return CUDA_SUCCESS; }
CUresult cuDriverGetVersion(int *v) { *v = 13000; return CUDA_SUCCESS; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) { *d = ordinal; return CUDA_SUCCESS; }
CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute a, CUdevice dev) {
  switch (a) {
  case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *pi = 232448; break;
  case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *pi = 132; break;
  case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *pi = 1024; break;
  case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *pi = 32; break;
  case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *pi = 9; break;
  case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *pi = 0; break;
  case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: *pi = 1980000; break;
  case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: *pi = 2619000; break;
  case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: *pi = 5120; break;
  default: *pi = 0;
  }
  return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice dev) { *c = (CUcontext)0x1; return CUDA_SUCCESS; }
CUresult cuCtxSetCurrent(CUcontext c) { return CUDA_SUCCESS; }
CUresult cuCtxGetCurrent(CUcontext *c) { *c = (CUcontext)0x1; return CUDA_SUCCESS; }
CUresult cuCtxGetDevice(CUdevice *d) { *d = 0; return CUDA_SUCCESS; }
CUresult cuCtxSetLimit(CUlimit l, size_t v) { return CUDA_SUCCESS; }
CUresult cuCtxGetLimit(size_t *v, CUlimit l) { *v = 0; return CUDA_SUCCESS; }
CUresult cuGetErrorString(CUresult e, const char **s) { *s = "null driver"; return CUDA_SUCCESS; }
CUresult cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus *st) { *st = CU_STREAM_CAPTURE_STATUS_NONE; return CUDA_SUCCESS; }
CUresult cuPointerGetAttribute(void *data, CUpointer_attribute a, CUdeviceptr p) { *(CUdeviceptr *)data = p; return CUDA_SUCCESS; }
CUresult cuPointerGetAttributes(unsigned int n, CUpointer_attribute *a, void **data, CUdeviceptr p) { return CUDA_SUCCESS; }
CUresult cuModuleLoadData(CUmodule *m, const void *image) { *m = (CUmodule)0x2; return CUDA_SUCCESS; }
CUresult cuModuleUnload(CUmodule m) { return CUDA_SUCCESS; }
CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name) { *f = (CUfunction)0x3; return CUDA_SUCCESS; }
CUresult cuFuncGetAttribute(int *pi, CUfunction_attribute a, CUfunction f) {
  *pi = a == CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK ? 1024 : a == CU_FUNC_ATTRIBUTE_NUM_REGS ? 32 : 0;
  return CUDA_SUCCESS;
}
CUresult cuFuncSetAttribute(CUfunction f, CUfunction_attribute a, int v) { return CUDA_SUCCESS; }
CUresult cuFuncSetCacheConfig(CUfunction f, CUfunc_cache c) { return CUDA_SUCCESS; }
CUresult cuOccupancyMaxActiveClusters(int *n, CUfunction f, const CUlaunchConfig *c) { *n = 1; return CUDA_SUCCESS; }
#undef cuLaunchKernelEx
CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **params, void **extra) {
  launches++;
  last_grid[0] = c->gridDimX; last_grid[1] = c->gridDimY; last_grid[2] = c->gridDimZ;
  return CUDA_SUCCESS;
}

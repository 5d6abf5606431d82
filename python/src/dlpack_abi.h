#pragma once
// The DLPack exchange ABI (legacy, unversioned capsules named "dltensor"),
// declared here from the public specification so that the extension needs no
// framework header. numpy >= 1.22, torch, CuPy and JAX all speak it.

#include <cstdint>

extern "C" {

enum DLDeviceTypeCode : int32_t {
  kDLCPU = 1,
  kDLCUDA = 2,
  kDLCUDAHost = 3,  // page-locked host memory: addressable by the CPU
  kDLROCM = 10,
  kDLCUDAManaged = 13,
};

enum DLDataTypeCodeValue : uint8_t {
  kDLInt = 0,
  kDLUInt = 1,
  kDLFloat = 2,
  kDLBfloat = 4,
  kDLBool = 6,
  kDLFloat8_e4m3fn = 10,  // DLPack 1.1 numbering (OCP E4M3, torch.float8_e4m3fn)
};

struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};

struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};

struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; null means compact row-major
  uint64_t byte_offset;
};

struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

}  // extern "C"

// The C++ CPU kernels as one translation unit (hetserve.runtime.kernels.native compiles this file):
// torch's headers are most of a build's time, so they are parsed once for both sources, not once
// per source. Each source includes only the ATen headers it uses (Tensor's methods, the dtype
// dispatch, empty_like), not ATen.h with every operator.

#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "paged_decode_cpu.cpp"
#include "layer_ops_cpu.cpp"

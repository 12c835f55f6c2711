# Environment for canopy's device scripts (sourced): results directory, NVRTC on the library
# path, NVLink multicast off, kernel cache outside $OUT, and the carried binary.
OUT=${OUT:-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export CANOPY_KERNEL_CACHE=/tmp/canopy-kernels
BIN=${CANOPY_BIN:-.device/canopy}

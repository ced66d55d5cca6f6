# Sourced by the GPU scripts of this folder once they have set $out: makes $out (an absolute
# path from then on), runs Python from this tree, and sets what NCCL and torch's symmetric
# memory need on the lent H200 machines (no NVLink multicast; no NCCL monitoring thread).
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_NCCL_ENABLE_MONITORING=0

source launch/device/env.sh
SETTINGS="- NCCL_P2P_USE_CUDA_MEMCPY=1 - NCCL_P2P_USE_CUDA_MEMCPY=1" DECODE_SETTINGS="- NCCL_P2P_USE_CUDA_MEMCPY=1" RANKS=2 DEADLINE=200 bash launch/device/ring-nccl-env.sh 2>&1 | tail -8

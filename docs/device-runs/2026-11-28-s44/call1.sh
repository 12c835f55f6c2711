# nvidia-h200-x4, build of 0557a20 (the session-43 fixes, first run on a GPU).
source launch/device/env.sh
nvidia-smi topo -m | head -6
PART="test check scaling mpi stall" CHECK_CASES="f32:2:ring f32:4:ring bf16:4:ring" DEADLINE=560 bash launch/device/peer-ring.sh

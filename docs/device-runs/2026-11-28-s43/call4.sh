source launch/device/env.sh
PART="test check" CHECK_CASES="f32:4:ring bf16:4:ring" DEADLINE=165 bash launch/device/peer-ring.sh

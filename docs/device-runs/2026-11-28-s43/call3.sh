source launch/device/env.sh
PART="test check scaling mpi" SWITCHES="on on" CHECK_CASES="f32:2:ring f32:4:ring bf16:4:ring" DEADLINE=470 bash launch/device/peer-ring.sh

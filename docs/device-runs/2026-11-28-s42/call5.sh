source launch/device/env.sh
PART="test stall mpi decode scaling check" DEADLINE=520 bash launch/device/peer-merge.sh

source launch/device/env.sh
nvidia-smi topo -m | head -8
log "copy engines, ring pattern"
python3 launch/device/tools/copy_ring.py 16 32 64 256 2>&1 | tee $OUT/copy-ring.txt
PART="test stall mpi decode scaling" DEADLINE=500 bash launch/device/peer-merge.sh

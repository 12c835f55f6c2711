# sanitizer.sh as committed: the fixtures' runs, then Llama-3.2-3B's shape with random weights
# under memcheck (1 and 2 ranks) and racecheck (hazards held against canopy's own kernels only).
timeout 540 bash launch/device/sanitizer.sh > /dev/null 2>&1; echo "exit $?"; cat $OUT/sanitizer.txt
for f in $OUT/sanitizer-*.txt; do case $f in *llama-3.2*) ;; *) rm -f "$f" ;; esac; done

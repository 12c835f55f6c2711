# sanitizer.sh: the fixtures' runs, then Llama-3.2-3B's shape with random weights under
# memcheck on 1 and 2 ranks (its decode groups of three rows on the tensor cores).
timeout 480 bash launch/device/sanitizer.sh > /dev/null 2>&1; echo "exit $?"; grep -E "PASS|FAIL|clean" $OUT/sanitizer.txt
# The runs' reports come back for the failing runs and the random-weight shapes alone.
for f in $OUT/sanitizer-*.txt; do grep -q "ERROR SUMMARY: 0 errors" "$f" && case $f in *llama-3*) ;; *) rm -f "$f" ;; esac; done; ls $OUT

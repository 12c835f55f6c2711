# sanitizer.sh with Llama-3.1-8B's shape (32/8 heads of 128, GQA 4) as ARCHS.
ARCHS=llama-3.1-8b timeout 500 bash launch/device/sanitizer.sh > /dev/null 2>&1; echo "exit $?"; cat $OUT/sanitizer.txt
for f in $OUT/sanitizer-*.txt; do case $f in *llama-3.1*) ;; *) rm -f "$f" ;; esac; done

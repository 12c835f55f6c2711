#!/usr/bin/env bash
# Call 6 (the command as run): the conformance suite on one rank, with the time it takes.
source launch/device/env.sh; s=$SECONDS; timeout 250 .device/canopy selftest --backend cuda --ranks 1 --cases 1 > $OUT/selftest-r1.txt 2>&1; echo "exit $? after $((SECONDS - s)) s"; tail -4 $OUT/selftest-r1.txt

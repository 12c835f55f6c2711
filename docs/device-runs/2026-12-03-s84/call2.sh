# shapes-check.sh PART=ab (ab-decode.sh with each shape's own contexts, the KV filled at random)
# as an A/A: this build as both canopy and canopy-old, so the rows show the run-to-run spread.
cp .device/canopy.gz .device/canopy-old.gz && PART=ab DEADLINE=280 ROUNDS=2 bash launch/device/shapes-check.sh

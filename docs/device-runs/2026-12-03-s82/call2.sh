DEADLINE=470 PART=model bash launch/device/shapes-check.sh   # the build of e9118aa

PART=tests bash launch/device/shapes-check.sh   # the build of e9118aa; the script then capped each selftest at half the time left (256 s), and both ran out

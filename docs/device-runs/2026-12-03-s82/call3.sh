DEADLINE=420 bash launch/device/kernel-choice.sh   # the build of e9118aa

source launch/device/env.sh
DEADLINE=560 bash launch/device/peer-ring.sh

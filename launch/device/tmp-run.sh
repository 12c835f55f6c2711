CHECK=true HEADS="8 32" TREES="0 1 2 3 4 5 6 7 8 9" METHODS=q-guided,deft-node,deft-node-chunk,deft-flatten,fasttree bash launch/device/quick-tree.sh 2>&1
TILES=32 HEADS="8 32" TREES="0 1 2 3 4 5 6 7 8 9" METHODS=deft-node,deft-node-chunk,deft-flatten,fasttree bash launch/device/quick-tree.sh 2>&1

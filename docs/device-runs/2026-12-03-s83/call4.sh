PART=tests KERNELS=mma DEADLINE=500 bash launch/device/shapes-check.sh   # the build of 51ea83c; graph_epoch, weight_upload and product_tuning carried (the rest not, size)

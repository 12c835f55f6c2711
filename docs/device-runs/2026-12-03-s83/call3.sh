R=$OUT; for a in llama-3.2-3b llama-3.1-8b; do OUT=$R/$a ARCH=$a CONTEXT=8K bash launch/device/decode-timeline.sh; done   # the build of 51ea83c; decode-timeline.sh with its ARCH knob

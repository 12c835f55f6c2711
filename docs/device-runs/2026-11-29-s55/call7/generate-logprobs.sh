#!/usr/bin/env bash
# `generate --json --logprobs` on the GPU against the CPU (the tiny fixture model, f32, two
# samples at a temperature, top_k 5): the same tokens, log-probabilities within 2e-3 and the
# same likeliest tokens. Results: $OUT/gen-cuda.json and gen-cpu.json, the verdict on stdout.
source launch/device/env.sh
T=tests/fixtures/tiny/gqa-hd64
for b in cuda cpu; do
  $BIN generate --model $T --backend $b --dtype f32 --prompt-ids 5,9,14,2,33 --max-tokens 12 --n 2 --temperature 0.8 --top-k 5 --json --logprobs 3 > $OUT/gen-$b.json 2> $OUT/gen-$b.err
done
python3 - <<'P'
import json,os
o=os.environ.get("OUT","out")
a=json.load(open(f"{o}/gen-cuda.json")); b=json.load(open(f"{o}/gen-cpu.json"))
ok=True
for sa,sb in zip(a["samples"],b["samples"]):
    ok &= sa["tokens"]==sb["tokens"]
    for x,y in zip(sa["logprobs"],sb["logprobs"]):
        ok &= abs(x["logprob"]-y["logprob"])<2e-3 and [t for t,_ in x["top"]]==[t for t,_ in y["top"]]
print("generate --logprobs, GPU against CPU:", "same" if ok else "DIFFERENT", a["samples"][0]["tokens"], a["samples"][0]["logprobs"][0])
P

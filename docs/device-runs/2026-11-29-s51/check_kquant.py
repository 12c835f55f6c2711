"""Runs canopy generate (CUDA, f32 and bf16) on tests/fixtures/kquant's GGUF for each prompt of
its reference and compares the greedy tokens and the first token's logits with transformers'."""
import json
import subprocess
import sys

ref = json.load(open("tests/fixtures/kquant/reference.json"))
ok = True
for dtype in ["f32", "bf16"]:
    for p in ref["prompts"]:
        ids = ",".join(map(str, p["token_ids"]))
        out = subprocess.run(
            [".device/canopy", "generate", "--model", "tests/fixtures/kquant/model.gguf", "--prompt-ids", ids,
             "--max-tokens", str(len(p["greedy_tokens"])), "--backend", "cuda", "--dtype", dtype, "--json", "--logits"],
            capture_output=True, text=True)
        if out.returncode != 0:
            print(dtype, p["length"], "FAILED", out.stderr[-400:])
            ok = False
            continue
        d = json.loads(out.stdout)
        tokens = d["samples"][0]["tokens"]
        first = d["logits"]["first"] if isinstance(d["logits"], dict) and "first" in d["logits"] else None
        diff = max(abs(a - b) for a, b in zip(first, p["logits_last"])) if first else float("nan")
        same = tokens == p["greedy_tokens"]
        ok &= same or dtype != "f32"
        print(f"{dtype} prompt {p['length']}: tokens {'equal' if same else 'DIFFER'}, first logits max abs diff {diff:.3g}")
print("ALL PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)

"""Requests for serve-fields.sh, with the standard library alone.

check GPU_URL CPU_URL PROMPTS_JSON: the same requests (log-probabilities, penalties, a logit
bias, several prompts, a streamed chat, echoed prompts with their log-probabilities) to a
server on the GPU and one on the CPU; the texts must be equal and the log-probabilities within
2e-3. Prints one line per request and ALL PASS
or FAILED.

sampled URL BIN MODEL PROMPTS_JSON: seeded completions at a temperature over the whole
vocabulary (no top_k) or cut by a top_k past 128, some with penalties, all in flight at once,
against `BIN generate` on the
GPU (on RANKS ranks, default 1) with the same seed, prompt and penalties: the texts must be
equal. Prints one line per request and ALL PASS or FAILED.

load URL: CONCURRENCY streamed completions at once (the same random token ids each time, so
that after the first run every prompt is found cached; ignore_eos), timed, in the variants
named by VARIANTS: a warm-up, none ask for log-probabilities, one does, all do, all are
penalised (by repetition, over their prompts), all are penalised by frequency and presence
(which only lower the logits of tokens drawn), all echo their prompts with their
log-probabilities; `greedy` (as `none`), and draws seeded by request at temperature 1 (`t1`),
at 0.1 (`t01`), at 1 cut by top_p 0.9 (`top-p`) or by top_k 40 (`top-k`); the last two
temperatures with frequency and presence penalties 0.5 (`t1-penalised`, `t01-penalised`), and
greedy draws with a logit bias that lifts two tokens (`lifting`). Prints one JSON line per
variant, with the decode rows read whole for their draws, and those whose draws went on over
the rest of the row on the device, where the server counts them.
"""
import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def post(url, path, body):
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        if body.get("stream"):
            chunks = []
            for line in r:
                line = line.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
            return chunks
        return json.loads(r.read())


def close(a, b, tol):
    if isinstance(a, float) or isinstance(b, float):
        return abs(a - b) <= tol
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(close(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(close(a[k], b[k], tol) for k in a)
    return a == b


def check(gpu, cpu, prompts):
    p = prompts
    cases = [
        ("completions logprobs 5", "/v1/completions",
         {"prompt": p[2], "max_tokens": 16, "temperature": 0, "logprobs": 5}),
        ("penalties", "/v1/completions",
         {"prompt": p[3], "max_tokens": 24, "temperature": 0, "frequency_penalty": 0.5,
          "presence_penalty": 0.2, "repetition_penalty": 1.3, "logprobs": 2}),
        ("logit_bias", "/v1/completions",
         {"prompt": p[1], "max_tokens": 8, "temperature": 0, "logit_bias": {"65": 5, "66": -100}}),
        ("several prompts, n=2", "/v1/completions",
         {"prompt": p[:3], "max_tokens": 12, "temperature": 0, "n": 2, "logprobs": 1}),
        ("echo with logprobs", "/v1/completions",
         {"prompt": p[3], "max_tokens": 2, "temperature": 0, "logprobs": 2, "echo": True}),
        ("echo with logprobs, max_tokens 0", "/v1/completions",
         {"prompt": p[3], "max_tokens": 0, "logprobs": 3, "echo": True}),
        ("echo with logprobs, streamed, two prompts", "/v1/completions",
         {"prompt": p[2:4], "max_tokens": 2, "temperature": 0, "logprobs": 1, "echo": True,
          "stream": True}),
        ("chat logprobs, streamed", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 12,
          "temperature": 0, "logprobs": True, "top_logprobs": 3, "stream": True}),
    ]
    ok = True
    for name, path, body in cases:
        a, b = post(gpu, path, body), post(cpu, path, body)
        if body.get("stream"):
            # Each choice's chunks in order; how two choices' chunks interleave is timing.
            def by_choice(chunks):
                return sorted((ch for c in chunks for ch in c["choices"]), key=lambda ch: ch["index"])
            a, b = by_choice(a), by_choice(b)
        else:
            a, b = a["choices"], b["choices"]
        same = close(a, b, 2e-3)
        ok &= same
        print(f"{name}: {'same' if same else 'DIFFERENT'}")
        if not same:
            print("  gpu:", json.dumps(a)[:600])
            print("  cpu:", json.dumps(b)[:600])
    print("ALL PASS" if ok else "FAILED")


def sampled(url, binary, model, prompts):
    draws = [(1.0, 1.0, {}), (0.8, 0.9, {}),
             (1.0, 1.0, {"frequency_penalty": 0.5, "presence_penalty": 0.3}),
             (0.8, 0.9, {"repetition_penalty": 1.3, "presence_penalty": -0.2}),
             (0.9, 1.0, {"top_k": 200}), (0.9, 0.95, {"top_k": 200, "frequency_penalty": 0.4})]
    cases = [(i, t, p, pen) for i in range(len(prompts)) for t, p, pen in draws]

    def served(case):
        i, t, p, pen = case
        body = {"prompt": prompts[i], "max_tokens": 16, "temperature": t, "top_p": p, "seed": 7, **pen}
        return post(url, "/v1/completions", body)["choices"][0]["text"]

    with ThreadPoolExecutor(len(cases)) as ex:
        got = list(ex.map(served, cases))
    ok = True
    for (i, t, p, pen), text in zip(cases, got):
        ids = ",".join(map(str, prompts[i]))
        flags = [a for k, v in pen.items() for a in ("--" + k.replace("_", "-"), str(v))]
        out = subprocess.run([binary, "generate", "--model", model, "--backend", "cuda", "--dtype", "f32",
                              "--prompt-ids", ids, "--max-tokens", "16", "--temperature", str(t),
                              "--top-p", str(p), "--seed", "7", "--json",
                              "--ranks", os.environ.get("RANKS", "1"), *flags],
                             capture_output=True, text=True, check=True)
        want = json.loads(out.stdout)["samples"][0]["text"]
        same = text == want
        ok &= same
        print(f"prompt {i}, temperature {t}, top_p {p}, {pen}: {'same' if same else 'DIFFERENT'} {text!r}")
        if not same:
            print("  generate:", repr(want))
    print("ALL PASS" if ok else "FAILED")


def counter(url, name):
    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        m = re.search(r"^%s (\S+)$" % name, r.read().decode(), re.M)
    return float(m.group(1)) if m else None


def rows_read_whole(url):
    return counter(url, "canopy_rows_read_whole_total")


def rows_tail_walked(url):
    return counter(url, "canopy_rows_tail_walked_total")


def load(url):
    concurrency = int(os.environ.get("CONCURRENCY", "32"))
    tokens = int(os.environ.get("OUTPUT_LEN", "64"))
    vocab = int(os.environ.get("VOCAB", "128000"))
    variants = os.environ.get("VARIANTS", "warm none one all penalties lowering echo none one").split()
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, vocab) for _ in range(256)] for _ in range(concurrency)]
    for variant in variants:
        def one(i):
            body = {"prompt": prompts[i], "max_tokens": tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            if variant == "all" or (variant == "one" and i == 0):
                body["logprobs"] = 5
            if variant == "penalties":
                body["repetition_penalty"] = 1.1
            if variant in ("lowering", "t1-penalised", "t01-penalised"):
                body.update(frequency_penalty=0.5, presence_penalty=0.5)
            if variant == "lifting":
                body["logit_bias"] = {str(prompts[i][0]): 5, str(prompts[i][1]): 3}
            if variant == "echo":
                body.update(logprobs=1, echo=True)
            draws = {"t1": (1.0, 1.0, 0), "t01": (0.1, 1.0, 0), "top-p": (1.0, 0.9, 0),
                     "top-k": (1.0, 1.0, 40), "t1-penalised": (1.0, 1.0, 0),
                     "t01-penalised": (0.1, 1.0, 0)}
            if variant in draws:
                t, p, k = draws[variant]
                body.update(temperature=t, top_p=p, top_k=k, seed=i)
            t = time.perf_counter()
            chunks = post(url, "/v1/completions", body)
            return time.perf_counter() - t, len(chunks)
        whole_before, walked_before = rows_read_whole(url), rows_tail_walked(url)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as ex:
            done = list(ex.map(one, range(concurrency)))
        wall = time.perf_counter() - t0
        whole_after, walked_after = rows_read_whole(url), rows_tail_walked(url)
        print(json.dumps({"variant": variant, "concurrency": concurrency, "output_len": tokens,
                          "wall_s": round(wall, 3),
                          "output_tokens_per_s": round(concurrency * tokens / wall, 1),
                          "slowest_request_s": round(max(d[0] for d in done), 3),
                          "rows_read_whole": None if whole_before is None else whole_after - whole_before,
                          "rows_tail_walked": None if walked_before is None else walked_after - walked_before}),
              flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "check":
        check(sys.argv[2], sys.argv[3], json.load(open(sys.argv[4])))
    elif sys.argv[1] == "sampled":
        sampled(sys.argv[2], sys.argv[3], sys.argv[4], json.load(open(sys.argv[5])))
    else:
        load(sys.argv[2])

import json, sys, urllib.request, re
from concurrent.futures import ThreadPoolExecutor
url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8791"
prompts = ["Write a short story about a lighthouse keeper.", "Explain how a rainbow forms.",
           "Give me three ideas for a birthday party.", "What is the capital of France, and why is it famous?",
           "Describe your favourite meal.", "How do I learn to play the guitar?",
           "Write a haiku about autumn.", "Summarize the plot of Romeo and Juliet.",
           "What are the benefits of exercise?", "Tell me a joke about computers.",
           "How does a bicycle work?", "Write a letter to a friend you have not seen in years.",
           "List five animals that live in the ocean.", "What should I pack for a beach holiday?",
           "Explain photosynthesis to a child.", "Invent a new board game and describe its rules."]
def metric(name):
    t = urllib.request.urlopen(url + "/metrics").read().decode()
    m = re.search(r"^%s (\S+)$" % name, t, re.M)
    return float(m.group(1)) if m else 0.0
def one(args):
    i, body = args
    body = dict(body, messages=[{"role": "user", "content": prompts[i]}], max_tokens=96, seed=i)
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req).read())["usage"]["completion_tokens"]
pen = {"frequency_penalty": 0.5, "presence_penalty": 0.5}
for name, body in [("temperature 1, top_p 0.95", {"top_p": 0.95}),
                   ("temperature 1, top_p 0.95, frequency and presence 0.5", dict(pen, top_p=0.95)),
                   ("temperature 0.9, top_k 200, repetition 1.2", {"temperature": 0.9, "top_k": 200, "repetition_penalty": 1.2})]:
    w0, g0 = metric("canopy_rows_read_whole_total"), metric("canopy_generation_tokens_total")
    k0 = metric("canopy_rows_tail_walked_total")
    with ThreadPoolExecutor(16) as ex:
        toks = sum(ex.map(one, [(i, body) for i in range(16)]))
    w1, g1 = metric("canopy_rows_read_whole_total"), metric("canopy_generation_tokens_total")
    k1 = metric("canopy_rows_tail_walked_total")
    decode_rows = (g1 - g0) - 16
    print(f"{name}: {w1-w0:.0f} of {decode_rows:.0f} decode rows read whole ({100*(w1-w0)/decode_rows:.1f}%), "
          f"{k1-k0:.0f} walked past their likeliest on the backend ({100*(k1-k0)/decode_rows:.1f}%)", flush=True)

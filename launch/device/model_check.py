#!/usr/bin/env python3
"""Correctness of canopy's CUDA model runtime against Hugging Face transformers.

The driver is launch/device/model-check.sh; this file holds everything it does in Python:

  reference  (torch, GPU) make two models with transformers and their fp32 references: a tiny
             random Llama (f32 weights) and a Llama-3.1-8B-shaped one (bf16 weights, few layers)
  plan G     print group G's canopy cases as TSV lines for the shell to run
             (G: fixtures, tiny-device, llama8b)
  compare    read canopy's outputs, compare them with the references and P ranks with one rank,
             write model-check.json and model-check.txt; exit 1 on any failure
  selftest   feed synthetic references and canopy outputs through plan's and compare's code
             (model_check_selftest.py beside this file; no GPU, no torch): run it after
             changing either file

Only `reference` imports torch, so the other commands run wherever numpy does.

Tolerances (relative = max |a - b| / max |ref| over the vocabulary):
  f32 vs reference   first logits and every decode step's top-2 logits within 1e-4 (1e-3 is
                     the pass bar, reported apart); greedy tokens identical.
  bf16 vs reference  first logits and the decode steps' top-2 logits within 2e-2, or within 2x
                     transformers' own bf16 error on the same prompt and the same steps where
                     that is larger (a model whose logits bf16 moves further, whoever computes
                     them; two bf16 implementations round at different points, so on one
                     prompt either may land further out than the other, by a factor of order
                     one); greedy tokens identical until the first disagreement, which must
                     come at a step whose reference top-2 gap is below 2x the run's largest
                     max abs logit error, of the first logits and of the decode steps before
                     it (a near-tie that rounding may flip).
  P ranks vs 1 rank  same model, prompt and dtype: f32 identical tokens and logits within 1e-5;
                     bf16 identical tokens until a first disagreement at a near-tie of the
                     one-rank run's own logits there (the context both runs saw), by the
                     one-rank run's bar as above (P ranks round their softmax weights to bf16
                     over their own part of the keys, as tensor-core attention does, so the
                     bits differ from one rank's).
Decode steps are compared while canopy's tokens follow the reference's (random models often
repeat one token, so the step logits check the decode path where the tokens cannot).
The references never stop on EOS; canopy stops on the models' EOS (id 0), and then only the
tokens it made are compared.
"""

import argparse
import copy
import json
import os
import random
import shutil
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.normpath(os.path.join(HERE, "..", "..", "tests", "fixtures"))
FIXTURE_VARIANTS = ("gqa-hd64", "llama3-hd128", "tied-mha-hd64")
TOKENIZER_SOURCE = "gqa-hd64"  # the fixture whose tokenizer the device models reuse

DEVICE = "cuda"  # where `reference` builds and runs the models
EOS_IDS = (0,)  # eos of every model here (the fixtures' and those made by `reference`)
F32_REL = 1e-4
F32_REL_LOOSE = 1e-3
BF16_REL = 2e-2
RANKS_F32_REL = 1e-5
GAP_FACTOR = 2.0
BF16_SPREAD = 2.0  # canopy's bf16 error may reach this multiple of transformers' own

DEVICE_GROUPS = ("tiny-device", "llama8b")
GROUP_ORDER = ("fixtures",) + DEVICE_GROUPS
PLAN_COLUMNS = ("name", "model", "model_dir", "ref", "prompt", "dtype", "ranks", "strategy",
                "max_tokens", "prompt_ids")

# The tiny model made on the device: a shape the fixtures lack (GQA groups of 3 heads of 128
# over KV heads in fours, as Llama-3.2-3B's 24/8: the prefill's tensor-core blocks are left
# short of full rows, and a decode step's three rows a group take the one-warp-per-head path;
# hidden = heads x head_dim; intermediate a multiple of 128), weights drawn as the fixtures'
# are (make_tiny_llamas).
TINY_DEVICE_CONFIG = dict(
    hidden_size=1536,
    num_attention_heads=12,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=512,
    num_hidden_layers=2,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
TINY_DEVICE_PROMPTS = (5, 70)
TINY_DEVICE_NEW_TOKENS = 32

# Llama-3.1-8B's shape; the layer count comes from --num-layers.
LLAMA8B_CONFIG = dict(
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=14336,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    max_position_embeddings=131072,
    tie_word_embeddings=False,
)
LLAMA8B_VOCAB = 128256
LLAMA8B_INIT_STD = 0.02


class CheckError(Exception):
    """A canopy output that cannot be compared (missing keys, wrong sizes)."""


def load_json(path):
    with open(path) as f:
        return json.load(f)


def write_json(path, value):
    with open(path, "w") as f:
        json.dump(value, f, indent=1)
        f.write("\n")


# ------------------------------------------------------------------------------- reference


def disable_tf32(torch):
    """fp32 references must be IEEE fp32 on the GPU: TF32 would put ~1e-3 relative error into
    the very numbers canopy's f32 path is held to 1e-4 against."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    return dict(matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
                cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
                float32_matmul_precision=torch.get_float32_matmul_precision())


def greedy_reference(torch, model, ids, new_tokens):
    """The prompt's last-position logits and a greedy continuation with the KV cache, in the
    fixtures' schema (reference.json's prompts[]). A plain loop rather than generate(), so that
    it never stops on EOS and every step's logits are at hand."""
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids], device=device), use_cache=True)
        logits = out.logits[0, -1].float()
        first = logits.clone()
        tokens, steps = [], []
        for i in range(new_tokens):
            top2 = torch.topk(logits, 2)
            token = int(top2.indices[0])
            tokens.append(token)
            steps.append(dict(token=token, max_logit=float(top2.values[0]),
                              second_token=int(top2.indices[1]),
                              second_logit=float(top2.values[1]),
                              gap=float(top2.values[0] - top2.values[1])))
            if i + 1 < new_tokens:
                out = model(input_ids=torch.tensor([[token]], device=device),
                            past_key_values=out.past_key_values, use_cache=True)
                logits = out.logits[0, -1].float()
    return dict(length=len(ids), token_ids=list(ids), logits_last=first.tolist(),
                greedy_tokens=tokens, greedy_steps=steps,
                min_gap=min(s["gap"] for s in steps))


def last_logits(torch, model, ids):
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, -1]
    return logits.float().cpu().numpy()


def bf16_steps_rel(torch, model, p):
    """step_logit_error's measure for `model` fed the reference's own greedy tokens (one
    forward pass over the prompt and them), over the prompt's scale: how far bf16 moves the
    decode steps' top-2 logits on the reference's path."""
    device = next(model.parameters()).device
    ids = list(p["token_ids"]) + list(p["greedy_tokens"][:-1])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], device=device)).logits[0].float().cpu().numpy()
    at = len(p["token_ids"]) - 1
    steps = [dict(logit=float(logits[at + i][ref["token"]]), second_token=ref["second_token"],
                  second_logit=float(logits[at + i][ref["second_token"]]))
             for i, ref in enumerate(p["greedy_steps"])]
    max_abs = step_logit_error(steps, p["greedy_steps"], len(steps))
    return max_abs / float(np.abs(np.asarray(p["logits_last"])).max())


def bf16_context(torch, model, prompts):
    """How far transformers itself lands from the fp32 reference in bf16, per prompt: all in
    bf16, the first logits (hf_bf16_rel) and the decode steps' on the reference's path
    (hf_bf16_steps_rel), and with only the weights rounded to bf16 and fp32 compute
    (hf_bf16_weights_rel). canopy's bf16 logits are held to the larger of the 2e-2 bar and
    these (compare_to_reference)."""
    m16 = copy.deepcopy(model).to(torch.bfloat16)
    m16w = copy.deepcopy(m16).float()

    def rel(m, p):
        return logit_error(last_logits(torch, m, p["token_ids"]), p["logits_last"])[1]

    context = [dict(hf_bf16_rel=rel(m16, p), hf_bf16_steps_rel=bf16_steps_rel(torch, m16, p),
                    hf_bf16_weights_rel=rel(m16w, p)) for p in prompts]
    del m16, m16w
    return context


def fixture_context(torch):
    """bf16_context of every committed fixture, keyed by its reference.json path as `plan`
    writes it (the fixtures' references were made on the CPU; the bf16 runs are here)."""
    from transformers import LlamaForCausalLM

    out = {}
    for v in FIXTURE_VARIANTS:
        model_dir = os.path.join(FIXTURES, "tiny", v)
        ref_path = os.path.join(model_dir, "reference.json")
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").to(DEVICE).eval()
        out[ref_path] = bf16_context(torch, model, load_json(ref_path)["prompts"])
    return out


def random_prompt(seed, length):
    """Token ids below the fixtures' tokenizer size (320), special ids 0-2 left out."""
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(length)]


def copy_tokenizer(model_dir):
    """The device models reuse a fixture's tokenizer: canopy only needs it to decode text."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(FIXTURES, "tiny", TOKENIZER_SOURCE, name), model_dir)


def reloaded(torch, model_dir):
    """The saved model read back in fp32, as canopy reads it: references come from the files,
    not from the model in memory, whose config may differ from what was written (the legacy
    RoPE keys are added to config.json after saving)."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                            attn_implementation="eager").to(DEVICE).eval()


def make_tiny_device(torch, mtl, work, seed):
    """A tiny random Llama from make_tiny_llamas' builder, saved in f32. Seeds are tried from
    `seed` until every greedy step's top-2 gap exceeds the fixtures' MIN_GAP, as there, so that
    exact f32 token agreement is a fair demand."""
    model_dir = os.path.join(work, "tiny-device")
    prompts = [random_prompt(seed + n, n) for n in TINY_DEVICE_PROMPTS]
    for s in range(seed, seed + 20):
        model = mtl.build_model(TINY_DEVICE_CONFIG, s, None).to(DEVICE)
        refs = [greedy_reference(torch, model, p, TINY_DEVICE_NEW_TOKENS) for p in prompts]
        if min(r["min_gap"] for r in refs) > mtl.MIN_GAP:
            break
    os.makedirs(model_dir, exist_ok=True)
    mtl.save_model(model, model_dir, dict(add_bos=False, config=TINY_DEVICE_CONFIG))
    copy_tokenizer(model_dir)
    model = reloaded(torch, model_dir)
    refs = [greedy_reference(torch, model, p, TINY_DEVICE_NEW_TOKENS) for p in prompts]
    for r, c in zip(refs, bf16_context(torch, model, refs)):
        r.update(c)
    return dict(name="tiny-device", model_dir=model_dir, seed=s, weights_dtype="float32",
                config=TINY_DEVICE_CONFIG, vocab_size=mtl.VOCAB_SIZE, prompts=refs)


def init_llama8b(torch, model, seed, norm_std):
    """Every weight from one seeded CUDA generator in a fixed order (independent of
    transformers' own init): matrices N(0, 0.02^2), RMSNorm weights 1 + N(0, norm_std^2) so a
    runtime that ignored them would fail."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                p.normal_(1.0, norm_std, generator=gen)
            else:
                p.normal_(0.0, LLAMA8B_INIT_STD, generator=gen)


def make_llama8b(torch, mtl, work, seed, num_layers, prompt_len, new_tokens):
    """The Llama-3.1-8B shape with `num_layers` layers, random weights built on the GPU and
    saved in bf16 (what canopy loads). The reference runs the saved bf16 weights, read back
    in fp32, on the GPU with TF32 off."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    model_dir = os.path.join(work, "llama8b")
    cfg = dict(LLAMA8B_CONFIG, num_hidden_layers=num_layers)
    config = LlamaConfig(vocab_size=LLAMA8B_VOCAB, bos_token_id=None, eos_token_id=0,
                         pad_token_id=0, hidden_act="silu", attention_bias=False,
                         mlp_bias=False, attn_implementation="eager", **copy.deepcopy(cfg))
    t = time.time()
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config)
    model.to(torch.bfloat16).eval()
    init_llama8b(torch, model, seed, mtl.NORM_STD)
    torch.cuda.synchronize()
    built_s = time.time() - t
    t = time.time()
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=0,
                                               pad_token_id=0, do_sample=False)
    model.save_pretrained(model_dir)
    mtl.add_legacy_rope_keys(os.path.join(model_dir, "config.json"), cfg)
    copy_tokenizer(model_dir)
    saved_s = time.time() - t
    t = time.time()
    del model
    model = reloaded(torch, model_dir)
    ref = greedy_reference(torch, model, random_prompt(seed, prompt_len), new_tokens)
    ref.update(bf16_context(torch, model, [ref])[0])
    reference_s = time.time() - t
    del model
    torch.cuda.empty_cache()
    return dict(name=f"llama8b-shaped-L{num_layers}", model_dir=model_dir, seed=seed,
                weights_dtype="bfloat16", config=cfg, vocab_size=LLAMA8B_VOCAB,
                prompts=[ref], seconds=dict(build=built_s, save=saved_s, reference=reference_s))


def reference_main(args):
    """Makes both device models and writes WORK/<group>.ref.json for each, then the fixtures'
    bf16 context (WORK/bf16-context.json); the GPU is free again when this process exits,
    before the device models' canopy runs."""
    import importlib.metadata

    import torch

    sys.path.insert(0, FIXTURES)
    import make_tiny_llamas as mtl

    os.makedirs(args.work, exist_ok=True)
    tf32 = disable_tf32(torch)
    versions = {n: importlib.metadata.version(n) for n in ("torch", "transformers", "numpy")}
    print(f"reference: {torch.cuda.get_device_name()}, {versions}, {tf32}")
    makers = (
        ("tiny-device", lambda: make_tiny_device(torch, mtl, args.work, args.seed)),
        ("llama8b", lambda: make_llama8b(torch, mtl, args.work, args.seed, args.num_layers,
                                         args.big_prompt_len, args.big_new_tokens)),
    )
    for group, make in makers:
        t = time.time()
        ref = make()
        ref.update(versions=versions, tf32=tf32, reference_total_s=time.time() - t)
        write_json(os.path.join(args.work, f"{group}.ref.json"), ref)
        gaps = ", ".join(f"{p['min_gap']:.3g}" for p in ref["prompts"])
        noise = ", ".join(f"{p['hf_bf16_rel']:.2e} (steps {p['hf_bf16_steps_rel']:.2e})"
                          for p in ref["prompts"])
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in ref.get("seconds", {}).items())
        print(f"reference: {ref['name']} (seed {ref['seed']}) in {time.time() - t:.1f} s "
              f"({parts or 'all'}); min top-2 gap per prompt {gaps}; "
              f"transformers bf16 vs fp32 rel {noise}")
        torch.cuda.empty_cache()
    t = time.time()
    context = fixture_context(torch)
    write_json(os.path.join(args.work, "bf16-context.json"), context)
    worst = max(c["hf_bf16_rel"] for prompts in context.values() for c in prompts)
    print(f"reference: fixtures' transformers bf16 vs fp32 rel up to {worst:.2e} "
          f"({time.time() - t:.1f} s)")
    print(f"reference: peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


# ------------------------------------------------------------------------------------ plan


def parse_configs(text):
    """'f32:1:tree bf16:3:ring ...' -> [(dtype, ranks, strategy)]: the matrix knobs of the
    shell script, checked here so that a typo fails before any canopy call."""
    configs = []
    for item in text.split():
        dtype, ranks, strategy = item.split(":")
        if dtype not in ("f32", "bf16") or strategy not in ("tree", "ring") or int(ranks) < 1:
            raise ValueError(f"bad case {item!r}: want DTYPE:RANKS:STRATEGY, "
                             "DTYPE f32|bf16, STRATEGY tree|ring")
        configs.append((dtype, int(ranks), strategy))
    return configs


def group_sources(group, work, variants, fixtures_root):
    """(model name, model dir, reference path) of every model of a group that has a
    reference; a device model whose reference is missing has none (compare reports it)."""
    if group == "fixtures":
        return [(v, os.path.join(fixtures_root, v), os.path.join(fixtures_root, v, "reference.json"))
                for v in variants]
    ref_path = os.path.join(work, f"{group}.ref.json")
    if not os.path.exists(ref_path):
        return []
    ref = load_json(ref_path)
    return [(ref["name"], ref["model_dir"], ref_path)]


def plan_rows(group, work, configs, variants, fixtures_root):
    """One row per canopy call: every prompt of every model of the group, in every config.
    max_tokens is the reference's greedy length, so a run that stops only at the limit
    covers the whole reference."""
    rows = []
    for model, model_dir, ref_path in group_sources(group, work, variants, fixtures_root):
        for i, prompt in enumerate(load_json(ref_path)["prompts"]):
            for dtype, ranks, strategy in configs:
                rows.append(dict(
                    name=f"{model}.p{len(prompt['token_ids'])}.{dtype}.r{ranks}.{strategy}",
                    model=model, model_dir=model_dir, ref=ref_path, prompt=i, dtype=dtype,
                    ranks=ranks, strategy=strategy, max_tokens=len(prompt["greedy_tokens"]),
                    prompt_ids=",".join(map(str, prompt["token_ids"]))))
    return rows


def plan_main(args):
    rows = plan_rows(args.group, args.work, parse_configs(args.configs), args.variants.split(),
                     os.path.join(FIXTURES, "tiny"))
    for row in rows:
        print("\t".join(str(row[c]) for c in PLAN_COLUMNS))


def read_plan(path):
    with open(path) as f:
        rows = [dict(zip(PLAN_COLUMNS, line.rstrip("\n").split("\t"))) for line in f if line.strip()]
    for row in rows:
        row["prompt"], row["ranks"] = int(row["prompt"]), int(row["ranks"])
        row["max_tokens"] = int(row["max_tokens"])
    return rows


# --------------------------------------------------------------------------------- compare


def logit_error(got, ref):
    """max |got - ref| and that over max |ref|: one scale for the whole vector, so that logits
    near zero do not inflate the relative error. NaN anywhere makes both NaN (and fail)."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if got.shape != ref.shape:
        raise CheckError(f"{got.size} logits where the reference has {ref.size}")
    diff = np.abs(got - ref)
    max_abs = float("nan") if np.isnan(diff).any() else float(diff.max())
    return max_abs, max_abs / float(np.abs(ref).max())


def first_difference(tokens, other):
    """The first step at which two token lists differ (the shorter's length where they agree)."""
    n = min(len(tokens), len(other))
    return next((i for i in range(n) if tokens[i] != other[i]), n)


def greedy_agreement(tokens, ref_tokens, ref_steps, gap_bar):
    """Where canopy's tokens first leave the reference's, and whether that is allowed: only at
    a step whose reference top-2 gap is below gap_bar (0: never). After a divergence the two
    continue from different contexts, so nothing later is compared."""
    n = min(len(tokens), len(ref_tokens))
    agreed = first_difference(tokens, ref_tokens)
    if agreed == n:
        return dict(agreed=n, compared=n, mismatch_gap=None, ok=True)
    gap = ref_steps[agreed]["gap"]
    return dict(agreed=agreed, compared=n, mismatch_gap=gap, ok=gap < gap_bar)


def step_logit_error(steps, ref_steps, n):
    """Largest |canopy - reference| over the chosen and (where the same token) runner-up
    logits of the first n decode steps: the decode path's logits, which `first` (prefill)
    does not cover."""
    errors = [0.0]
    for got, ref in zip(steps[:n], ref_steps[:n]):
        errors.append(abs(got["logit"] - ref["max_logit"]))
        if got["second_token"] == ref["second_token"]:
            errors.append(abs(got["second_logit"] - ref["second_logit"]))
    return float(np.max(errors))  # NaN-propagating, unlike max()


def reference_errors(tokens, steps, first, ref_prompt, before=None):
    """A run's logits against the reference: the first logits' max abs and relative error, and
    the decode steps' max abs (step_logit_error) over the steps before its tokens first leave
    the reference's, where both saw the same context (and before step `before`, if given)."""
    max_abs, rel = logit_error(first, ref_prompt["logits_last"])
    agreed = first_difference(tokens, ref_prompt["greedy_tokens"])
    n = agreed if before is None else min(agreed, before)
    return max_abs, rel, step_logit_error(steps, ref_prompt["greedy_steps"], n)


def near_tie_bar(max_abs, step_max_abs):
    """The top-2 gap below which bf16 rounding may flip a greedy token: GAP_FACTOR x the
    largest logit error the run showed against the reference (NaN-propagating)."""
    return GAP_FACTOR * float(np.max([max_abs, step_max_abs]))


def sample_and_logits(out):
    """Sample 0 and its logits from canopy's JSON, checked against the contract: one step per
    generated token, each step's token the sample's."""
    try:
        sample, logits = out["samples"][0], out["logits"]
        tokens, steps, first = sample["tokens"], logits["steps"], logits["first"]
    except (KeyError, IndexError, TypeError) as e:
        raise CheckError(f"canopy's JSON lacks {e} (samples[0].tokens, logits.first, logits.steps)")
    if [s["token"] for s in steps] != tokens:
        raise CheckError(f"logits.steps has {len(steps)} steps whose tokens are not "
                         f"samples[0].tokens ({len(tokens)} tokens)")
    # JSON has no NaN: serde writes a non-finite f32 as null. Keep it a NaN, which fails.
    nan = float("nan")
    first = [nan if x is None else x for x in first]
    steps = [{k: nan if v is None else v for k, v in s.items()} for s in steps]
    return sample, tokens, steps, first


def length_check(sample, expected):
    """(ok, note): canopy may end before the reference's length only on an EOS token, which
    the references (eos_token_id=None) never stop on."""
    tokens, reason = sample["tokens"], sample.get("finish_reason")
    if len(tokens) == expected:
        return True, ""
    if len(tokens) < expected and reason == "stop" and tokens and tokens[-1] in EOS_IDS:
        return True, f"stopped on EOS after {len(tokens)} of {expected}; prefix compared"
    return False, f"{len(tokens)} tokens (finish_reason {reason}), reference has {expected}"


def bf16_bar(hf_bf16_rel):
    """The bf16 logits' bar: 2e-2, or BF16_SPREAD x transformers' own bf16 error where larger."""
    return max(BF16_REL, BF16_SPREAD * (hf_bf16_rel or 0.0))


def compare_to_reference(out, ref_prompt, dtype):
    """One canopy run against the fp32 transformers reference (tolerances: module docstring)."""
    sample, tokens, steps, first = sample_and_logits(out)
    max_abs, rel, step_max_abs = reference_errors(tokens, steps, first, ref_prompt)
    scale = float(np.abs(np.asarray(ref_prompt["logits_last"])).max())
    len_ok, note = length_check(sample, len(ref_prompt["greedy_tokens"]))
    f32 = dtype == "f32"
    gap_bar = 0.0 if f32 else near_tie_bar(max_abs, step_max_abs)
    agree = greedy_agreement(tokens, ref_prompt["greedy_tokens"], ref_prompt["greedy_steps"], gap_bar)
    step_rel = step_max_abs / scale
    bar = F32_REL_LOOSE if f32 else bf16_bar(ref_prompt.get("hf_bf16_rel"))
    step_bar = F32_REL_LOOSE if f32 else bf16_bar(ref_prompt.get("hf_bf16_steps_rel"))
    logits_ok = rel <= bar and step_rel <= step_bar
    notes = [note] if note else []
    if agree["mismatch_gap"] is not None:
        notes.append(f"diverged at step {agree['agreed']} (ref gap {agree['mismatch_gap']:.2e}"
                     + ("" if f32 else f", bar {gap_bar:.2e}") + ")")
    if not f32 and agree["mismatch_gap"] is None:
        near = next((i for i, s in enumerate(ref_prompt["greedy_steps"]) if s["gap"] < gap_bar), None)
        if near is not None and near < agree["agreed"]:
            notes.append(f"agreed through near-tie steps from {near} (bar {gap_bar:.2e})")
    passed = len_ok and agree["ok"] and logits_ok
    strict = f32 and rel <= F32_REL and step_rel <= F32_REL
    return dict(max_abs=max_abs, rel=rel, step_max_abs=step_max_abs, step_rel=step_rel,
                tokens_agreed=agree["agreed"], tokens_compared=agree["compared"],
                tokens_reference=len(ref_prompt["greedy_tokens"]),
                gap_bar=None if f32 else gap_bar, mismatch_gap=agree["mismatch_gap"],
                finish_reason=sample.get("finish_reason"), ok=passed,
                status=("pass" if strict or not f32 else "pass@1e-3") if passed else "fail",
                note="; ".join(notes),
                hf_bf16_rel=None if f32 else ref_prompt.get("hf_bf16_rel"),
                hf_bf16_weights_rel=None if f32 else ref_prompt.get("hf_bf16_weights_rel"))


def compare_ranks(out, base, dtype, ref_prompt):
    """A run on P ranks against the model's one-rank run of the same prompt and dtype: for f32,
    identical tokens and logits within RANKS_F32_REL (prefill and every agreed step); for bf16,
    identical tokens until a first disagreement at a near-tie of the one-rank run's own logits
    there (the context both runs saw, which after the one-rank run has left the reference's
    tokens is not the reference's): its top-2 gap below near_tie_bar of the one-rank run's
    errors against the reference before that step."""
    _, tokens, steps, first = sample_and_logits(out)
    _, base_tokens, base_steps, base_first = sample_and_logits(base)
    max_abs, rel = logit_error(first, base_first)
    scale = float(np.abs(np.asarray(base_first, dtype=np.float64)).max())
    n = min(len(tokens), len(base_tokens))
    agreed = first_difference(tokens, base_tokens)
    step_max_abs = float(np.max([0.0] + [abs(a["logit"] - b["logit"])
                                         for a, b in zip(steps[:agreed], base_steps[:agreed])]))
    step_rel = step_max_abs / scale
    identical = tokens == base_tokens
    tokens_ok = identical
    notes = []
    if not identical:
        gap = (base_steps[agreed]["logit"] - base_steps[agreed]["second_logit"]
               if agreed < len(base_steps) else None)
        gap_bar = 0.0
        if dtype != "f32" and gap is not None:
            base_max_abs, _, base_step_max_abs = reference_errors(
                base_tokens, base_steps, base_first, ref_prompt, before=agreed)
            gap_bar = near_tie_bar(base_max_abs, base_step_max_abs)
            tokens_ok = gap < gap_bar
        notes.append(f"tokens differ from step {agreed} ({len(tokens)} vs {len(base_tokens)} tokens"
                     + (f"; one rank's top-2 gap there {gap:.2e}" if gap is not None else "")
                     + (f", near-tie bar {gap_bar:.2e}" if gap_bar else "") + ")")
    logits_ok = dtype != "f32" or (rel <= RANKS_F32_REL and step_rel <= RANKS_F32_REL)
    if not logits_ok:
        notes.append(f"f32 logits differ beyond {RANKS_F32_REL:g}")
    passed = tokens_ok and logits_ok
    return dict(max_abs=max_abs, rel=rel, step_max_abs=step_max_abs, step_rel=step_rel,
                tokens_agreed=agreed, tokens_compared=n, tokens_identical=identical, ok=passed,
                status="pass" if passed else "fail", note="; ".join(notes))


def load_run(runs, name):
    """A case's outcome from the files model-check.sh leaves: NAME.rc ('exit seconds'),
    NAME.json (stdout). No .rc: never started (time ran out)."""
    rc_path = os.path.join(runs, f"{name}.rc")
    if not os.path.exists(rc_path):
        return dict(status="skipped", note="not run: its phase's time ran out", seconds=None)
    with open(rc_path) as f:
        rc, seconds = (int(x) for x in f.read().split())
    if rc in (124, 137):
        return dict(status="error", note=f"timed out after {seconds} s", seconds=seconds)
    if rc != 0:
        return dict(status="error", note=f"exit {rc} after {seconds} s", seconds=seconds)
    try:
        return dict(status="ok", out=load_json(os.path.join(runs, f"{name}.json")), seconds=seconds)
    except (OSError, ValueError) as e:
        return dict(status="error", note=f"stdout is not one JSON document ({e})", seconds=seconds)


def case_record(kind, row, result, ref_name=None):
    """One line of model-check.json: which run, against what, the numbers, pass."""
    record = dict(kind=kind, model=row["model"], prompt_len=len(row["prompt_ids"].split(",")),
                  dtype=row["dtype"], ranks=row["ranks"], strategy=row["strategy"],
                  against=ref_name or "fp32 reference", name=row["name"])
    record.update(result)
    record["pass"] = record.pop("ok", False)
    return record


def error_record(name, note):
    """A failure that belongs to no single canopy run (a missing reference, an empty plan)."""
    return {"kind": "reference", "model": name, "prompt_len": None, "dtype": None,
            "ranks": None, "strategy": None, "against": "-", "name": name, "status": "error",
            "note": note, "pass": False}


def load_reference(path, context):
    """A reference.json with transformers' bf16 numbers (bf16_context) merged into its prompts
    where `reference` measured them apart (the fixtures)."""
    ref = load_json(path)
    for prompt, extra in zip(ref["prompts"], context.get(path, [])):
        prompt.update(extra)
    return ref


def compare_rows(rows, runs, context):
    """Every planned case against its reference, then every run against the first run of the
    same model, prompt and dtype that produced output (the plan puts 1 rank, tree, first)."""
    records, refs, base = [], {}, {}
    for row in rows:
        run = load_run(runs, row["name"])
        if run["status"] != "ok":
            records.append(case_record("reference", row, dict(status=run["status"], note=run["note"],
                                                             seconds=run["seconds"])))
            continue
        if row["ref"] not in refs:
            refs[row["ref"]] = load_reference(row["ref"], context)
        ref = refs[row["ref"]]
        ref_prompt = ref["prompts"][row["prompt"]]
        try:
            result = compare_to_reference(run["out"], ref_prompt, row["dtype"])
        except CheckError as e:
            records.append(case_record("reference", row, dict(status="error", note=str(e),
                                                             seconds=run["seconds"])))
            continue
        result["seconds"] = run["seconds"]
        records.append(case_record("reference", row, result))
        key = (row["model"], row["prompt"], row["dtype"])
        if key not in base:
            base[key] = (row, run["out"])
            continue
        base_row, base_out = base[key]
        result = compare_ranks(run["out"], base_out, row["dtype"], ref_prompt)
        records.append(case_record("ranks", row, result,
                                   f"{base_row['ranks']} rank(s) {base_row['strategy']}"))
    return records


def missing_reference_records(work, expect):
    """A failure per expected device model whose reference was never written."""
    return [error_record(g, "no reference: `model_check.py reference` failed or timed out "
                            "(reference.log)")
            for g in expect if not os.path.exists(os.path.join(work, f"{g}.ref.json"))]


def fmt(x, spec=".2e"):
    return "-" if x is None else format(x, spec)


def summary_lines(records):
    """The numbers a reader wants first: worst errors per comparison, greedy agreement,
    and what failed."""
    lines = []
    for kind, dtype in (("reference", "f32"), ("reference", "bf16"),
                        ("ranks", "f32"), ("ranks", "bf16")):
        done = [r for r in records if r["kind"] == kind and r["dtype"] == dtype and "rel" in r]
        if not done:
            continue
        passed = sum(r["pass"] for r in done)
        worst = max(done, key=lambda r: (r["rel"] != r["rel"], r["rel"]))
        against = "fp32 reference" if kind == "reference" else "its first config (1 rank)"
        line = (f"{dtype} vs {against}: "
                f"{passed}/{len(done)} pass; worst first-logits rel {worst['rel']:.2e} "
                f"(max abs {worst['max_abs']:.2e}, {worst['name']}); worst step rel "
                f"{float(np.max([r['step_rel'] for r in done])):.2e}")
        if kind == "reference" and dtype == "f32":
            strict = sum(r["status"] == "pass" for r in done)
            line += f"; within {F32_REL:g}: {strict}/{len(done)}"
        if kind == "reference" and dtype == "bf16":
            agreed = sum(r["tokens_agreed"] for r in done)
            compared = sum(r["tokens_compared"] for r in done)
            allowed = sum(r["mismatch_gap"] is not None and r["pass"] for r in done)
            bad = sum(r["mismatch_gap"] is not None and r["mismatch_gap"] >= r["gap_bar"] for r in done)
            line += (f"; greedy tokens agreed {agreed}/{compared}; divergences at a near-tie "
                     f"(allowed) {allowed}, above the gap bar (failures) {bad}")
            hf = [r for r in done if r.get("hf_bf16_rel") is not None]
            if hf:
                line += (f"; transformers' own bf16 on the same prompts: worst rel "
                         f"{max(r['hf_bf16_rel'] for r in hf):.2e} (bf16 weights, fp32 compute: "
                         f"{max(r['hf_bf16_weights_rel'] for r in hf):.2e}); canopy above it in "
                         f"{sum(r['rel'] > r['hf_bf16_rel'] for r in hf)}/{len(hf)}")
        if kind == "ranks":
            line += f"; identical tokens {sum(r['tokens_identical'] for r in done)}/{len(done)}"
        lines.append(line)
    for status in ("error", "skipped"):
        n = sum(r["status"] == status for r in records)
        if n:
            lines.append(f"{status}: {n} case(s) (counted as failures)")
    return lines


def table(records):
    """model-check.txt's table, one line per case (hf_bf16: transformers' own bf16 rel on the
    same prompt, for bf16 cases against the reference)."""
    head = (f"{'kind':9} {'model':20} {'plen':>4} {'dtype':5} {'P':>1} {'strat':5} {'max_abs':>8} "
            f"{'rel':>8} {'step_rel':>8} {'hf_bf16':>8} {'tokens':>7} {'result':9} note")
    lines = [head, "-" * len(head)]
    for r in records:
        tokens = f"{r['tokens_agreed']}/{r['tokens_compared']}" if "tokens_agreed" in r else "-"
        lines.append(f"{r['kind']:9} {r['model']:20} {fmt(r['prompt_len'], 'd'):>4} "
                     f"{r['dtype'] or '-':5} {fmt(r['ranks'], 'd'):>1} {r['strategy'] or '-':5} "
                     f"{fmt(r.get('max_abs')):>8} {fmt(r.get('rel')):>8} {fmt(r.get('step_rel')):>8} "
                     f"{fmt(r.get('hf_bf16_rel')):>8} {tokens:>7} {r['status']:9} {r.get('note', '')}")
    return lines


def read_timings(work):
    path = os.path.join(work, "timings.tsv")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    return [dict(phase=phase, seconds=int(seconds), note=note) for phase, seconds, note in lines]


def failure_kinds(records):
    """What the failures of `records` were, so that cases not reached for time are not read
    as cases that failed: "2 failed, 1 errored, 20 not run for time"."""
    failed = [r for r in records if not r["pass"]]
    count = lambda status: sum(r["status"] == status for r in failed)  # noqa: E731
    not_run, errored = count("skipped"), count("error")
    return (f"{len(failed) - not_run - errored} failed, {errored} errored, "
            f"{not_run} not run for time")


def compare_main(args):
    """Writes OUT/model-check.json and .txt, prints the table, ends with ALL PASS or
    FAILURES: n (how many failed, errored, or were not run for time: all three count), and
    returns the exit status."""
    rows = []
    for group in GROUP_ORDER:
        path = os.path.join(args.work, f"plan-{group}.tsv")
        if os.path.exists(path):
            rows += read_plan(path)
    context_path = os.path.join(args.work, "bf16-context.json")
    context = load_json(context_path) if os.path.exists(context_path) else {}
    records = compare_rows(rows, os.path.join(args.work, "runs"), context)
    records += missing_reference_records(args.work, args.expect.split(",") if args.expect else [])
    if not records:
        records.append(error_record("-", "no case was planned"))
    failures = sum(not r["pass"] for r in records)
    verdict = "ALL PASS" if failures == 0 else f"FAILURES: {failures} ({failure_kinds(records)})"
    timings = read_timings(args.work)
    refs = {}
    for group in DEVICE_GROUPS:
        path = os.path.join(args.work, f"{group}.ref.json")
        if os.path.exists(path):
            ref = load_json(path)
            refs[ref["name"]] = {k: v for k, v in ref.items() if k != "prompts"} | dict(
                prompts=[{k: v for k, v in p.items() if k not in ("logits_last", "greedy_steps")}
                         for p in ref["prompts"]])
    tolerances = dict(f32_rel=F32_REL, f32_rel_pass_bar=F32_REL_LOOSE, bf16_rel=BF16_REL,
                      bf16_spread=BF16_SPREAD, ranks_f32_rel=RANKS_F32_REL,
                      bf16_gap_factor=GAP_FACTOR, eos_ids=EOS_IDS)
    write_json(os.path.join(args.out, "model-check.json"),
               dict(verdict=verdict, failures=failures, tolerances=tolerances, timings=timings,
                    device_models=refs, cases=records))
    lines = table(records) + ["", "== summary"] + summary_lines(records)
    lines += [f"{t['phase']}: {t['seconds']} s {t['note']}".rstrip() for t in timings]
    lines.append(verdict)
    with open(os.path.join(args.out, "model-check.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if verdict == "ALL PASS" else 1


# ------------------------------------------------------------------------------------ main


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("reference", help="make the device models and their fp32 references")
    p.add_argument("--work", required=True)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--big-prompt-len", type=int, default=100)
    p.add_argument("--big-new-tokens", type=int, default=16)
    p = sub.add_parser("plan", help="print a group's canopy cases as TSV")
    p.add_argument("group", choices=GROUP_ORDER)
    p.add_argument("--work", required=True)
    p.add_argument("--configs", required=True, help="DTYPE:RANKS:STRATEGY ...")
    p.add_argument("--variants", default=" ".join(FIXTURE_VARIANTS))
    p = sub.add_parser("compare", help="compare canopy's outputs with the references")
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--expect", default="", help="device groups whose references must exist")
    sub.add_parser("selftest", help="the comparison logic on synthetic data")
    args = parser.parse_args()
    if args.command == "selftest":
        import model_check_selftest  # beside this file; it imports this module's functions

        sys.exit(model_check_selftest.selftest_main(args) or 0)
    commands = dict(reference=reference_main, plan=plan_main, compare=compare_main)
    sys.exit(commands[args.command](args) or 0)


if __name__ == "__main__":
    main()

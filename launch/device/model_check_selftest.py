"""model_check.py's selftest: synthetic references and canopy outputs fed through its plan and
compare code, each case with the verdict it must get (no GPU, no torch). Run as `model_check.py
selftest` after changing either file; CI runs it."""

import argparse
import contextlib
import copy
import io
import os
import tempfile

import numpy as np

from model_check import (BF16_REL, BF16_SPREAD, PLAN_COLUMNS, compare_main, compare_ranks,
                         compare_rows, compare_to_reference, failure_kinds, load_json,
                         parse_configs, plan_rows, write_json)


def fake_reference(rng, prompt_lens, vocab, new_tokens, gaps):
    """A fixture-shaped reference.json with chosen top-2 gaps per step (gaps[i])."""
    prompts = []
    for n in prompt_lens:
        logits = rng.normal(0.0, 1.0, vocab)
        tokens = [int(t) for t in rng.integers(3, vocab, new_tokens)]
        steps = []
        for i, t in enumerate(tokens):
            second = (t + 1) % vocab
            steps.append(dict(token=t, max_logit=3.0, second_token=second,
                              second_logit=3.0 - gaps[i], gap=gaps[i]))
        prompts.append(dict(token_ids=[int(x) for x in rng.integers(3, vocab, n)],
                            logits_last=[float(x) for x in logits], greedy_tokens=tokens,
                            greedy_steps=steps, min_gap=min(gaps)))
    return dict(prompts=prompts)


def fake_output(ref_prompt, tokens, noise, rng, finish_reason="length"):
    """What canopy would print for a run whose logits are the reference's plus uniform noise
    of size `noise` (each step's top two shifted by it, so their gap is the reference's), and
    whose sample is `tokens`."""
    ref = np.asarray(ref_prompt["logits_last"])
    first = ref + rng.uniform(-noise, noise, ref.size)
    steps = []
    for i, t in enumerate(tokens):
        ref = ref_prompt["greedy_steps"][i]
        steps.append(dict(token=t, logit=ref["max_logit"] + noise, second_token=ref["second_token"],
                          second_logit=ref["second_logit"] + noise))
    return dict(samples=[dict(tokens=tokens, text="", finish_reason=finish_reason)],
                logits=dict(first=[float(x) for x in first], steps=steps))


def nulled(out):
    """A canopy output whose logits went non-finite (serde writes NaN as null)."""
    out["logits"]["first"][3] = None
    out["logits"]["steps"][2]["logit"] = None
    return out


def selftest_main(_args):
    """Synthetic references and canopy outputs through plan_rows, compare_rows and
    compare_main, with the verdict each case must get."""
    rng = np.random.default_rng(7)
    gaps = [0.5, 0.5, 0.01, 0.5, 0.5, 0.5, 0.5, 0.5]
    with tempfile.TemporaryDirectory() as tmp:
        fixtures = os.path.join(tmp, "fixtures")
        work = os.path.join(tmp, "work")
        runs = os.path.join(work, "runs")
        os.makedirs(os.path.join(fixtures, "m"))
        os.makedirs(runs)
        ref = fake_reference(rng, [1, 9], 64, 8, gaps)
        ref["prompts"][1]["greedy_tokens"][5] = 0  # an EOS the reference does not stop on
        ref["prompts"][1]["greedy_steps"][5]["token"] = 0
        write_json(os.path.join(fixtures, "m", "reference.json"), ref)
        configs = parse_configs("f32:1:tree f32:2:tree f32:2:ring f32:3:ring "
                                "bf16:1:tree bf16:3:tree bf16:3:ring bf16:2:tree bf16:2:ring")
        rows = plan_rows("fixtures", work, configs, ["m"], fixtures)
        assert len(rows) == 18 and rows[0]["name"] == "m.p1.f32.r1.tree", rows[0]
        with open(os.path.join(work, "plan-fixtures.tsv"), "w") as f:
            f.writelines("\t".join(str(r[c]) for c in PLAN_COLUMNS) + "\n" for r in rows)
        p0, p1 = ref["prompts"]
        t0, t1 = p0["greedy_tokens"], p1["greedy_tokens"]
        swap = lambda ts, i: ts[:i] + [(ts[i] + 2) % 64] + ts[i + 1:]  # noqa: E731
        # (prompt, config) -> (canopy output or an exit status, expected reference verdict,
        # expected ranks verdict or None where the run is the baseline or did not run)
        scenarios = {
            "m.p1.f32.r1.tree": (fake_output(p0, t0, 0.0, rng), "pass", None),
            "m.p1.f32.r2.tree": (fake_output(p0, t0, 1e-3, rng), "pass@1e-3", "fail"),
            "m.p1.f32.r2.ring": (fake_output(p0, swap(t0, 4), 1e-6, rng), "fail", "fail"),
            "m.p1.f32.r3.ring": (fake_output(p0, t0, 1e-8, rng), "pass", "pass"),
            "m.p1.bf16.r1.tree": (fake_output(p0, swap(t0, 2), 1e-2, rng), "pass", None),
            # Leaves the one-rank run (swapped at step 2) at step 2, a near-tie: allowed.
            "m.p1.bf16.r3.tree": (fake_output(p0, swap(t0, 4), 1e-2, rng), "fail", "pass"),
            "m.p1.bf16.r3.ring": (fake_output(p0, swap(t0, 2), 0.2, rng), "fail", "pass"),
            "m.p1.bf16.r2.tree": (124, "error", None),
            # m.p1.bf16.r2.ring: no .rc, so skipped
            "m.p9.f32.r1.tree": (fake_output(p1, t1[:6], 0.0, rng, "stop"), "pass", None),
            "m.p9.f32.r2.tree": (fake_output(p1, t1[:4], 0.0, rng, "stop"), "fail", "fail"),
            "m.p9.f32.r2.ring": (dict(samples=[dict(tokens=[1])]), "error", None),
            "m.p9.f32.r3.ring": (nulled(fake_output(p1, t1[:6], 0.0, rng, "stop")), "fail", "fail"),
        }
        for name, (run, _, _) in scenarios.items():
            with open(os.path.join(runs, f"{name}.rc"), "w") as f:
                f.write(f"{run if isinstance(run, int) else 0} 3\n")
            if not isinstance(run, int):
                write_json(os.path.join(runs, f"{name}.json"), run)
        records = compare_rows(rows, runs, {})
        got = {(r["name"], r["kind"]): r for r in records}
        for name, (_, want_ref, want_ranks) in scenarios.items():
            r = got[(name, "reference")]
            assert r["status"] == want_ref, (name, r)
            if want_ranks is not None:
                assert got[(name, "ranks")]["status"] == want_ranks, (name, got[(name, "ranks")])
        assert got[("m.p1.bf16.r2.ring", "reference")]["status"] == "skipped"
        assert "stopped on EOS after 6 of 8" in got[("m.p9.f32.r1.tree", "reference")]["note"]
        assert got[("m.p1.bf16.r1.tree", "reference")]["tokens_agreed"] == 2
        assert all(r["status"] == "skipped" for r in records
                   if r["name"].startswith("m.p9") and r["name"] not in scenarios)
        # P ranks leaving one rank's tokens at a step where its top-2 gap is wide fail in bf16
        # too; at a near-tie only bf16 passes. The gap is the one-rank run's own: a near-tie of
        # its logits where the reference's gap is wide passes, a wide gap of its own where the
        # reference's is narrow fails.
        one = fake_output(p0, t0, 1e-2, rng)
        for at, dtype, ok in [(4, "bf16", False), (2, "bf16", True), (2, "f32", False)]:
            result = compare_ranks(fake_output(p0, swap(t0, at), 1e-2, rng), one, dtype, p0)
            assert result["ok"] == ok, (at, dtype, result)
        for at, own_gap, ok in [(4, 5e-3, True), (2, 0.5, False)]:
            own = copy.deepcopy(one)
            step = own["logits"]["steps"][at]
            step["second_logit"] = step["logit"] - own_gap
            result = compare_ranks(fake_output(p0, swap(t0, at), 1e-2, rng), own, "bf16", p0)
            assert result["ok"] == ok, (at, own_gap, result)
        # A bf16 divergence from the reference is a near-tie by the run's largest logit error,
        # the decode steps' before it as well as the first logits'.
        loose = dict(p0, hf_bf16_rel=1.0, hf_bf16_steps_rel=1.0)
        quiet = fake_output(p0, swap(t0, 3), 1e-3, rng)
        assert not compare_to_reference(quiet, loose, "bf16")["ok"]  # gap 0.5, bar 2e-3
        quiet["logits"]["steps"][1]["logit"] += 0.3
        assert compare_to_reference(quiet, loose, "bf16")["ok"]  # gap 0.5, bar 0.6
        # Logits bf16 moves past the 2e-2 bar pass within BF16_SPREAD x transformers' own bf16
        # error on the prompt, and fail past it.
        loud = fake_output(p0, t0, 0.15, rng)
        plain = compare_to_reference(loud, p0, "bf16")
        worst = max(plain["rel"], plain["step_rel"])
        assert worst > BF16_REL and not plain["ok"], plain
        both = lambda x: dict(p0, hf_bf16_rel=x * worst, hf_bf16_steps_rel=x * worst)  # noqa: E731
        assert compare_to_reference(loud, both(1.1 / BF16_SPREAD), "bf16")["ok"]
        assert not compare_to_reference(loud, both(0.9 / BF16_SPREAD), "bf16")["ok"]
        out = os.path.join(tmp, "out")
        os.makedirs(out)
        with contextlib.redirect_stdout(io.StringIO()):
            status = compare_main(argparse.Namespace(work=work, out=out, expect="tiny-device"))
        written = load_json(os.path.join(out, "model-check.json"))
        with open(os.path.join(out, "model-check.txt")) as f:
            last = f.read().splitlines()[-1]
        kinds = failure_kinds(written["cases"])
        assert status == 1 and last == f"FAILURES: {written['failures']} ({kinds})", (status, last)
        assert kinds.endswith(" not run for time") and " 0 not run" not in kinds, kinds
        assert written["cases"][-1]["name"] == "tiny-device" and not written["cases"][-1]["pass"]
        # A clean run passes.
        for name in os.listdir(runs):
            os.remove(os.path.join(runs, name))
        for row in rows:
            prompt = ref["prompts"][row["prompt"]]
            eos_at = prompt["greedy_tokens"].index(0) + 1 if 0 in prompt["greedy_tokens"] else None
            tokens = prompt["greedy_tokens"][:eos_at]
            write_json(os.path.join(runs, f"{row['name']}.json"),
                       fake_output(prompt, tokens, 0.0, rng, "stop" if eos_at else "length"))
            with open(os.path.join(runs, f"{row['name']}.rc"), "w") as f:
                f.write("0 1\n")
        with contextlib.redirect_stdout(io.StringIO()):
            assert compare_main(argparse.Namespace(work=work, out=out, expect="")) == 0
    print("selftest: ok")
    return 0

//! The CUDA backend's ops on logits against the CPU backend's, on fresh random rows with
//! ties, signed zeros and infinities: the narrowing to each row's likeliest tokens bit for bit,
//! each row's log-normaliser and a target's logit, each row's softmax total at its
//! temperature (the CPU sums in f64), single logits picked and set bit for bit, and the
//! rest of draws walked past rows' likeliest tokens.
//!
//! Without a GPU every test prints why and passes. The seed is printed; `CANOPY_TEST_SEED`
//! repeats a run.

mod common;
mod compare;
use common::{gpu, rng};
use compare::poisoned;

use canopy_core::logits::{softmax_total, top_tokens, TailCut, TailWalk};
use canopy_engine::{CpuBackend, LayerOps, Result, TOP_LOGITS_MAX};
use canopy_kernels::TOP_ROUNDS_MAX;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// `logits` (`rows × vocab`) narrowed to `k` tokens a row on `b`, into a poisoned output.
fn top<B: LayerOps>(b: &B, logits: &[f32], rows: usize, k: usize) -> Result<Vec<f32>> {
    let t = b.upload_tensor(logits, rows, logits.len() / rows)?;
    let mut out = poisoned(b, rows, 2 * k)?;
    b.top_logits(&t, k, &mut out)?;
    b.download_tensor(&out)
}

#[test]
fn top_logits_match_the_cpu_bit_for_bit() {
    let Some(gpu) = gpu("top_logits_match_the_cpu_bit_for_bit") else {
        return;
    };
    let mut rng = rng("top_logits_match_the_cpu_bit_for_bit");
    // Vocabularies of one segment, one past it, SmolLM2's and Llama 3's (two passes), and
    // one small enough that k reaches most of it.
    for (rows, vocab) in [(3, 4096), (2, 4097), (5, 49152), (64, 128256), (1, 130)] {
        // Few distinct values, so most of a row's likeliest tie: the lower token must win.
        // Signed zeros and infinities sit among them.
        let mut tied: Vec<f32> = (0..rows * vocab)
            .map(|_| rng.gen_range(-64i32..64) as f32 * 0.125)
            .collect();
        for _ in 0..rows * 4 {
            let at = rng.gen_range(0..tied.len());
            tied[at] = [0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY][rng.gen_range(0..4)];
        }
        // A model's spread, where the likeliest part by the bits of their logits.
        let spread = model_rows(&mut rng, rows, vocab);
        // k on both sides of TOP_ROUNDS_MAX (rounds of the largest key, and radix selection),
        // up to the most a row is narrowed to, which takes 128,256 logits through four passes.
        for (kind, logits) in [("tied", &tied), ("spread", &spread)] {
            let ks = [
                1,
                2,
                TOP_ROUNDS_MAX,
                TOP_ROUNDS_MAX + 1,
                40,
                128,
                700,
                TOP_LOGITS_MAX,
            ];
            for k in ks.into_iter().filter(|&k| k <= vocab) {
                let got = top(&gpu, logits, rows, k).unwrap();
                let want = top(&CpuBackend, logits, rows, k).unwrap();
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "{kind}: {rows} rows of {vocab}, k = {k}"
                );
            }
            eprintln!("  top_logits {kind} {rows} × {vocab}: equal at every k");
        }
    }
}

/// `rows × vocab` logits of a model's spread, one row in ten peaked on a token.
fn model_rows(rng: &mut impl Rng, rows: usize, vocab: usize) -> Vec<f32> {
    let mut logits: Vec<f32> = (0..rows * vocab)
        .map(|_| rng.gen_range(-12.0f32..12.0))
        .collect();
    for r in (0..rows).step_by(10) {
        logits[r * vocab + rng.gen_range(0..vocab)] = 80.0;
    }
    logits
}

/// Each row's log-normaliser and its target's logit on `b`, into a poisoned output.
fn terms<B: LayerOps>(b: &B, logits: &[f32], rows: usize, targets: &[u32]) -> Result<Vec<f32>> {
    let t = b.upload_tensor(logits, rows, logits.len() / rows)?;
    let mut out = poisoned(b, rows, 2)?;
    b.logprob_terms(&t, targets, &mut out)?;
    b.download_tensor(&out)
}

#[test]
fn logprob_terms_match_the_cpu() {
    let Some(gpu) = gpu("logprob_terms_match_the_cpu") else {
        return;
    };
    let mut rng = rng("logprob_terms_match_the_cpu");
    for (rows, vocab) in [(3, 4096), (2, 4097), (5, 49152), (64, 128256), (1, 130)] {
        let logits = model_rows(&mut rng, rows, vocab);
        let targets: Vec<u32> = (0..rows).map(|_| rng.gen_range(0..vocab as u32)).collect();
        let got = terms(&gpu, &logits, rows, &targets).unwrap();
        let want = terms(&CpuBackend, &logits, rows, &targets).unwrap();
        for (r, (g, w)) in got.chunks(2).zip(want.chunks(2)).enumerate() {
            // fp32 sums of up to 128K terms against f64's: a few parts in 10^6.
            assert!(
                (g[0] - w[0]).abs() <= 2e-5 * w[0].abs().max(1.0),
                "row {r}: {g:?} {w:?}"
            );
            assert_eq!(
                g[1].to_bits(),
                w[1].to_bits(),
                "row {r}: the target's logit"
            );
        }
        eprintln!("  logprob_terms {rows} × {vocab}: within 2e-5");
    }
    // A target past the row is refused.
    let t = gpu.upload_tensor(&[0.5; 8], 2, 4).unwrap();
    let mut out = poisoned(&gpu, 2, 2).unwrap();
    assert!(gpu.logprob_terms(&t, &[1, 4], &mut out).is_err());
}

/// Each row's softmax total at its temperature on `b`, into a poisoned output.
fn totals<B: LayerOps>(
    b: &B,
    logits: &[f32],
    rows: usize,
    temperatures: &[f32],
) -> Result<Vec<f32>> {
    let t = b.upload_tensor(logits, rows, logits.len() / rows)?;
    let mut out = poisoned(b, rows, 1)?;
    b.softmax_totals(&t, temperatures, &mut out)?;
    b.download_tensor(&out)
}

#[test]
fn softmax_totals_match_the_cpu() {
    let Some(gpu) = gpu("softmax_totals_match_the_cpu") else {
        return;
    };
    let mut rng = rng("softmax_totals_match_the_cpu");
    for (rows, vocab) in [(3, 4096), (2, 4097), (5, 49152), (64, 128256), (1, 130)] {
        // Some -inf among them.
        let mut logits = model_rows(&mut rng, rows, vocab);
        for _ in 0..rows {
            logits[rng.gen_range(0..rows * vocab)] = f32::NEG_INFINITY;
        }
        let temperatures: Vec<f32> = (0..rows).map(|_| rng.gen_range(0.05f32..2.0)).collect();
        let got = totals(&gpu, &logits, rows, &temperatures).unwrap();
        let want = totals(&CpuBackend, &logits, rows, &temperatures).unwrap();
        for (r, (g, w)) in got.iter().zip(&want).enumerate() {
            // fp32 sums of up to 128K terms against f64's: a few parts in 10^6.
            assert!(
                (g - w).abs() <= 2e-5 * w.abs(),
                "row {r} at {}: {g} {w}",
                temperatures[r]
            );
            assert!(*w >= 1.0, "the row's largest term is 1");
        }
        eprintln!("  softmax_totals {rows} × {vocab}: within 2e-5");
    }
    // A temperature of 0 is refused.
    let t = gpu.upload_tensor(&[0.5; 8], 2, 4).unwrap();
    let mut out = poisoned(&gpu, 2, 1).unwrap();
    assert!(gpu.softmax_totals(&t, &[1.0, 0.0], &mut out).is_err());
}

/// The logits at `picks` on `b`, into a poisoned output.
fn picked<B: LayerOps>(
    b: &B,
    logits: &[f32],
    rows: usize,
    picks: &[(u32, u32)],
) -> Result<Vec<f32>> {
    let t = b.upload_tensor(logits, rows, logits.len() / rows)?;
    let mut out = poisoned(b, picks.len(), 1)?;
    b.pick_logits(&t, picks, &mut out)?;
    b.download_tensor(&out)
}

#[test]
fn pick_logits_match_the_cpu_bit_for_bit() {
    let Some(gpu) = gpu("pick_logits_match_the_cpu_bit_for_bit") else {
        return;
    };
    let mut rng = rng("pick_logits_match_the_cpu_bit_for_bit");
    for (rows, vocab, n) in [(3, 4096, 1), (64, 128256, 5000), (1, 130, 130)] {
        let logits = model_rows(&mut rng, rows, vocab);
        // Repeats among them, and the last entry of the last row.
        let mut picks: Vec<(u32, u32)> = (0..n)
            .map(|_| {
                (
                    rng.gen_range(0..rows) as u32,
                    rng.gen_range(0..vocab) as u32,
                )
            })
            .collect();
        picks.push(picks[0]);
        picks.push((rows as u32 - 1, vocab as u32 - 1));
        let got = picked(&gpu, &logits, rows, &picks).unwrap();
        let want = picked(&CpuBackend, &logits, rows, &picks).unwrap();
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want), "{rows} rows of {vocab}");
        eprintln!("  pick_logits {} of {rows} × {vocab}: equal", picks.len());
    }
    // A pick past the row is refused.
    let t = gpu.upload_tensor(&[0.5; 8], 2, 4).unwrap();
    let mut out = poisoned(&gpu, 1, 1).unwrap();
    assert!(gpu.pick_logits(&t, &[(1, 4)], &mut out).is_err());
}

/// `logits` with -inf set at `places` on `b`, and each row's softmax total at its temperature
/// after.
fn set_then_totals<B: LayerOps>(
    b: &B,
    logits: &[f32],
    rows: usize,
    places: &[(u32, u32)],
    temperatures: &[f32],
) -> Result<(Vec<f32>, Vec<f32>)> {
    let mut t = b.upload_tensor(logits, rows, logits.len() / rows)?;
    b.set_logits(&mut t, places, f32::NEG_INFINITY)?;
    let mut out = poisoned(b, rows, 1)?;
    b.softmax_totals(&t, temperatures, &mut out)?;
    Ok((b.download_tensor(&t)?, b.download_tensor(&out)?))
}

#[test]
fn totals_without_set_logits_match_the_cpu() {
    let Some(gpu) = gpu("totals_without_set_logits_match_the_cpu") else {
        return;
    };
    let mut rng = rng("totals_without_set_logits_match_the_cpu");
    for (rows, vocab) in [(4, 49152), (32, 128256), (2, 130)] {
        let logits = model_rows(&mut rng, rows, vocab);
        // Each row's largest among the places, as a draw that lowers it leaves it out.
        let mut places: Vec<(u32, u32)> = (0..rows * 60)
            .map(|_| {
                (
                    rng.gen_range(0..rows) as u32,
                    rng.gen_range(0..vocab) as u32,
                )
            })
            .collect();
        for r in 0..rows {
            let row = &logits[r * vocab..(r + 1) * vocab];
            let top = (0..vocab)
                .max_by(|&a, &b| row[a].total_cmp(&row[b]))
                .unwrap();
            places.push((r as u32, top as u32));
        }
        let temperatures: Vec<f32> = (0..rows).map(|_| rng.gen_range(0.05f32..2.0)).collect();
        let (got_rows, got) = set_then_totals(&gpu, &logits, rows, &places, &temperatures).unwrap();
        let (want_rows, want) =
            set_then_totals(&CpuBackend, &logits, rows, &places, &temperatures).unwrap();
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&got_rows),
            bits(&want_rows),
            "{rows} × {vocab}: the rows set"
        );
        let mut worst = 0.0f32;
        for (r, (g, w)) in got.iter().zip(&want).enumerate() {
            let off = (g - w).abs() / w.abs();
            assert!(off <= 2e-5, "row {r} at {}: {g} {w}", temperatures[r]);
            worst = worst.max(off);
        }
        eprintln!("  set_logits then softmax_totals {rows} × {vocab}: within {worst:.1e}");
    }
    let mut t = gpu.upload_tensor(&[0.5; 8], 2, 4).unwrap();
    assert!(gpu.set_logits(&mut t, &[(2, 0)], 0.0).is_err());
}

/// Where `walks` land in `logits` (`rows × vocab`) on `b`, into a poisoned output.
fn walked<B: LayerOps>(
    b: &B,
    logits: &[f32],
    rows: usize,
    walks: &[(usize, &TailWalk)],
) -> Vec<f32> {
    let t = b.upload_tensor(logits, rows, logits.len() / rows).unwrap();
    let mut out = poisoned(b, walks.len(), 2).unwrap();
    b.walk_tails(&t, walks, &mut out).unwrap();
    b.download_tensor(&out).unwrap()
}

#[test]
fn tail_walks_land_where_the_cpus_do() {
    let Some(gpu) = gpu("tail_walks_land_where_the_cpus_do") else {
        return;
    };
    let mut rng = rng("tail_walks_land_where_the_cpus_do");
    // A model's spread; rows of few distinct logits, whose cuts fall among thousands of equal
    // ones (taken by token id); and rows as flat as a random model's, whose cuts fall among
    // hundreds of near ones.
    let tied = |rng: &mut ChaCha8Rng, rows: usize, vocab: usize| -> Vec<f32> {
        (0..rows * vocab)
            .map(|_| rng.gen_range(-8i32..8) as f32 * 0.25)
            .collect()
    };
    let flat = |rng: &mut ChaCha8Rng, rows: usize, vocab: usize| -> Vec<f32> {
        (0..rows * vocab)
            .map(|_| rng.gen_range(-2.0f32..2.0))
            .collect()
    };
    let cases = [
        (3, 4096, model_rows(&mut rng, 3, 4096)),
        (31, 128256, model_rows(&mut rng, 31, 128256)),
        (2, 130, model_rows(&mut rng, 2, 130)),
        (3, 128256, tied(&mut rng, 3, 128256)),
        (3, 128256, flat(&mut rng, 3, 128256)),
    ];
    for (rows, vocab, logits) in cases {
        let mut walks = Vec::new();
        for r in 0..rows {
            let row = &logits[r * vocab..(r + 1) * vocab];
            let temperature = rng.gen_range(0.3f32..2.0);
            let head = top_tokens(row, 128.min(vocab - 1));
            let walk = TailWalk {
                max: row[head[0] as usize],
                head,
                temperature,
                total: f64::from(softmax_total(row, temperature)),
                target: 0.0,
                cut: None,
                changed: vec![],
            };
            let tail: f64 = (0..vocab as u32)
                .filter(|t| !walk.head.contains(t))
                .map(|t| walk.prob(row[t as usize]))
                .sum();
            // Targets across the tail's mass, and one past it.
            for share in [0.0, rng.gen_range(0.0..1.0), rng.gen_range(0.0..1.0), 1.5] {
                let target = share * tail;
                walks.push((
                    r,
                    TailWalk {
                        target,
                        ..walk.clone()
                    },
                ));
            }
            // top_p cuts past the head: near it, anywhere, and near the whole row.
            let head_mass: f64 = (walk.head.iter())
                .map(|&t| walk.prob(row[t as usize]))
                .sum();
            // (A row one token holds leaves no cut past its head.)
            let shares = match head_mass < 0.99 {
                true => vec![0.01, rng.gen_range(0.0..1.0), 0.999],
                false => Vec::new(),
            };
            for share in shares {
                let cut = TailCut {
                    u: rng.gen_range(0.0..1.0),
                    top_p: head_mass + share * (1.0 - head_mass),
                    head_mass,
                };
                walks.push((
                    r,
                    TailWalk {
                        cut: Some(cut),
                        ..walk.clone()
                    },
                ));
            }
            // A draw that lowers some tokens past its head (penalties) walks its row with their
            // changed logits, over the changed row's total: without a cut and with one.
            let mut changed: Vec<(u32, f32)> = (0..40)
                .map(|_| (rng.gen_range(0..vocab as u32), rng.gen_range(0.5f32..4.0)))
                .filter(|(t, _)| !walk.head.contains(t))
                .map(|(t, lower)| (t, row[t as usize] - lower))
                .collect();
            changed.sort_unstable_by_key(|&(t, _)| t);
            changed.dedup_by_key(|&mut (t, _)| t);
            let mut changed_row = row.to_vec();
            changed
                .iter()
                .for_each(|&(t, x)| changed_row[t as usize] = x);
            let lowered = TailWalk {
                total: f64::from(softmax_total(&changed_row, temperature)),
                changed,
                ..walk.clone()
            };
            let tail: f64 = (0..vocab as u32)
                .filter(|t| !walk.head.contains(t))
                .map(|t| lowered.prob(changed_row[t as usize]))
                .sum();
            let target = rng.gen_range(0.0..1.0) * tail;
            walks.push((
                r,
                TailWalk {
                    target,
                    ..lowered.clone()
                },
            ));
            if head_mass < 0.99 {
                let cut = TailCut {
                    u: rng.gen_range(0.0..1.0),
                    top_p: head_mass + rng.gen_range(0.0..1.0) * (1.0 - head_mass),
                    head_mass,
                };
                walks.push((
                    r,
                    TailWalk {
                        cut: Some(cut),
                        ..lowered
                    },
                ));
            }
        }
        let refs: Vec<(usize, &TailWalk)> = walks.iter().map(|(r, w)| (*r, w)).collect();
        let got = walked(&gpu, &logits, rows, &refs);
        let want = walked(&CpuBackend, &logits, rows, &refs);
        let mut neighbours = 0;
        for (i, (r, walk)) in walks.iter().enumerate() {
            let model_row = &logits[r * vocab..(r + 1) * vocab];
            let (g, w) = (got[2 * i].to_bits(), want[2 * i].to_bits());
            // The landed token's logit is the model's, changed or not.
            assert_eq!(
                got[2 * i + 1].to_bits(),
                model_row[g as usize].to_bits(),
                "walk {i}'s logit"
            );
            // The row the walk walks: the changed logits in place.
            let mut row = model_row.to_vec();
            walk.changed.iter().for_each(|&(t, x)| row[t as usize] = x);
            if g == w {
                continue;
            }
            assert!(walk.cut.is_none(), "walk {i}, cut: GPU {g}, CPU {w}");
            // Another token only where the target lies within rounding of its boundary.
            neighbours += 1;
            let before: f64 = (0..g)
                .filter(|t| !walk.head.contains(t))
                .map(|t| walk.prob(row[t as usize]))
                .sum();
            let q = walk.prob(row[g as usize]);
            assert!(
                before - 1e-9 <= walk.target && walk.target < before + q + 1e-9,
                "walk {i}: GPU {g}, CPU {w}, target {} outside [{before}, {})",
                walk.target,
                before + q
            );
        }
        eprintln!(
            "  walk_tails, {} walks over {rows} × {vocab}: {neighbours} on a neighbour",
            walks.len()
        );
    }
    // A walk past the rows is refused.
    let t = gpu.upload_tensor(&[0.5; 8], 2, 4).unwrap();
    let mut out = poisoned(&gpu, 1, 2).unwrap();
    let walk = TailWalk {
        head: vec![],
        max: 0.5,
        temperature: 1.0,
        total: 4.0,
        target: 0.1,
        cut: None,
        changed: vec![],
    };
    assert!(gpu.walk_tails(&t, &[(2, &walk)], &mut out).is_err());
    // So is a changed token past the row.
    let past = TailWalk {
        changed: vec![(4, 0.0)],
        ..walk
    };
    assert!(gpu.walk_tails(&t, &[(0, &past)], &mut out).is_err());
}

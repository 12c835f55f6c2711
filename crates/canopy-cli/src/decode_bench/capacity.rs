//! The longest context a device holds at each rank count, priced before anything is
//! allocated, so that `bench decode` refuses a context that does not fit with the numbers
//! instead of failing part-way.

use super::report::Capacity;
use super::{request, DecodeArgs, FillChoice};
use anyhow::{anyhow, bail, Result};
use canopy_core::DType;
use canopy_engine::ModelNeeds;
use canopy_model::LlamaConfig;
use canopy_runtime::DecodeStrategy;

/// Contexts the capacity search tries at most: beyond any device's memory, short of a
/// pricing that would itself take memory (the KV books list every page).
const SEARCH_TOKENS: usize = 1 << 28;

/// The longest context device 0 (of `backend`) holds at each rank count, with the most ranks
/// a device holds at that count (`rank_counts`' pairs), priced by `check_model` (its
/// backend's, as the runs will be); a requested context that does not fit is refused here
/// with the numbers, before anything is allocated.
pub(super) fn price(
    a: &DecodeArgs,
    rank_counts: &[(usize, usize)],
    config: &LlamaConfig,
    dtype: DType,
    backend: &str,
    check_model: &dyn Fn(&ModelNeeds) -> Result<()>,
) -> Result<Vec<Capacity>> {
    let longest = a.contexts().iter().max().copied().unwrap_or(1);
    let search = match a.context_fill {
        FillChoice::Prefill => config.max_position_embeddings.saturating_sub(a.decode),
        FillChoice::Random => SEARCH_TOKENS,
    };
    // The prompt's ids do not matter to the price, only its length.
    let pricing = request(a, config, dtype, 1, DecodeStrategy::Ring)?;
    let mut out = Vec::new();
    for &(ranks, here) in rank_counts {
        let check = |context: usize| -> Result<()> {
            let needs = pricing.needs_at(context, config, dtype, ranks, here)?;
            check_model(&needs.on_device_holding(here, ranks))
        };
        let fits = longest_fitting(search, |c| check(c).is_ok());
        let verdict = match longest <= search {
            true => check(longest),
            false => Err(anyhow!("it passes the {search} tokens canopy prices")),
        };
        if let Err(e) = verdict {
            let at_most = fits.map_or(
                "not even one token fits beside the weights".to_string(),
                |n| format!("the longest context that fits is {n} tokens"),
            );
            let hint = match a.context_fill {
                FillChoice::Prefill => "; --context-fill random needs no prefill activations",
                FillChoice::Random => "",
            };
            bail!(
                "a context of {longest} tokens at {ranks} rank(s) ({}) does not fit {} device 0: {e:#}; at {ranks} rank(s) {at_most}{hint}",
                a.context_fill.name(),
                backend
            );
        }
        out.push(Capacity {
            ranks,
            context_fill: a.context_fill.name(),
            longest_context: fits,
            bound_by: match (fits, a.context_fill) {
                (Some(n), FillChoice::Prefill) if n == search => "positions",
                (Some(n), FillChoice::Random) if n == search => "the search's limit",
                _ => "memory",
            },
        });
    }
    Ok(out)
}

/// The largest `n` in `1..=most` with `fits(n)`, for a `fits` that holds up to some length and
/// not beyond: doubling, then bisection. `None` when not even 1 fits.
fn longest_fitting(most: usize, fits: impl Fn(usize) -> bool) -> Option<usize> {
    if most == 0 || !fits(1) {
        return None;
    }
    let (mut lo, mut hi) = (1, 2);
    while hi <= most && fits(hi) {
        lo = hi;
        hi *= 2;
    }
    // fits(lo); hi does not fit, or is past `most`.
    let mut hi = hi.min(most + 1);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Some(lo)
}

#[cfg(test)]
mod tests {
    use super::super::tests::parse;
    use super::*;

    #[test]
    fn the_longest_fitting_context_is_found_exactly() {
        for limit in [1, 2, 3, 1000, 131_071, 900_001] {
            let found = longest_fitting(SEARCH_TOKENS, |n| n <= limit);
            assert_eq!(found, Some(limit));
        }
        assert_eq!(longest_fitting(500, |n| n <= 1000), Some(500), "capped");
        assert_eq!(longest_fitting(500, |_| false), None);
        assert_eq!(longest_fitting(0, |_| true), None);
    }

    #[test]
    fn a_context_beyond_the_device_is_refused_with_the_numbers() {
        let a = parse(&[
            "--arch",
            "llama-3.1-8b",
            "--random-weights",
            "--context",
            "64,1M",
            "--context-fill",
            "random",
            "--ranks",
            "1",
        ]);
        let config = canopy_model::presets::preset("llama-3.1-8b").unwrap();
        // A device with 40 GiB free for the KV cache.
        let calls = std::cell::Cell::new(0);
        let check = |needs: &ModelNeeds| {
            calls.set(calls.get() + 1);
            let (need, free) = (needs.kv_bytes(), 40u64 << 30);
            match need <= free {
                true => Ok(()),
                false => bail!("the KV cache needs {need} bytes but {free} are free"),
            }
        };
        let err = price(&a, &[(1, 1)], &config, DType::Bf16, "test", &check)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("a context of 1048576 tokens at 1 rank(s)"),
            "{err}"
        );
        assert!(
            err.contains("the KV cache needs 137443147776 bytes"),
            "{err}"
        );
        // 128 KiB of bf16 KV a token in pages of 16, and two pages for the decoded tokens:
        // 40 GiB hold 20480 pages, so 20478 pages of context.
        assert!(
            err.contains("the longest context that fits is 327648 tokens"),
            "{err}"
        );
        assert!(calls.get() < 80, "{} prices", calls.get());
        let a = parse(&[
            "--arch",
            "llama-3.1-8b",
            "--random-weights",
            "--context-fill",
            "random",
        ]);
        let fits = price(&a, &[(1, 1)], &config, DType::Bf16, "test", &check).unwrap();
        assert_eq!(fits[0].longest_context, Some(327648));
        assert_eq!(fits[0].bound_by, "memory");
        // Past the search, a context is refused unpriced: its KV books alone would take
        // gigabytes.
        let a = parse(&[
            "--arch",
            "llama-3.1-8b",
            "--random-weights",
            "--context",
            "4294967200",
            "--context-fill",
            "random",
        ]);
        let err = price(&a, &[(1, 1)], &config, DType::Bf16, "test", &check)
            .unwrap_err()
            .to_string();
        assert!(err.contains("passes the 268435456 tokens"), "{err}");
        assert!(
            err.contains("the longest context that fits is 327648"),
            "{err}"
        );
    }
}

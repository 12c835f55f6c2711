//! The checks of the logit ops' arguments ([`LayerOps::top_logits`](crate::LayerOps::top_logits)
//! and the ops that read rows beside it), shared by every backend so that each refuses the same
//! calls with the same message.

use crate::layer_ops::expect_size;
use crate::{EngineError, Result};
use canopy_core::logits::TailWalk;

/// The most tokens [`LayerOps::top_logits`](crate::LayerOps::top_logits) narrows a row to; a draw
/// that may reach further (a `top_k` above it, or a change of more tokens than it leaves room for)
/// reads the whole row. A row narrowed to this many is 8 KB, against 513 KB for Llama 3's
/// vocabulary.
pub const TOP_LOGITS_MAX: usize = 1024;

/// Refuses a [`LayerOps::top_logits`](crate::LayerOps::top_logits) call whose `k` is 0, past
/// [`TOP_LOGITS_MAX`] or past the row, or whose output is not `rows × 2k`.
pub fn check_top_logits(
    backend: &'static str,
    (rows, vocab): (usize, usize),
    k: usize,
    out: (usize, usize),
) -> Result<()> {
    if k == 0 || k > TOP_LOGITS_MAX || k > vocab {
        return Err(EngineError::Backend {
            backend,
            message: format!(
                "top_logits: k = {k} must be from 1 to {} and at most the {vocab} logits of a row",
                TOP_LOGITS_MAX
            ),
        });
    }
    expect_size(backend, "top_logits", "the output's rows", out.0, rows)?;
    expect_size(backend, "top_logits", "the output's columns", out.1, 2 * k)
}

/// Refuses a [`LayerOps::logprob_terms`](crate::LayerOps::logprob_terms) call without a target per
/// row, with a target past the row, or whose output is not `rows × 2`.
pub fn check_logprob_terms(
    backend: &'static str,
    (rows, vocab): (usize, usize),
    targets: &[u32],
    out: (usize, usize),
) -> Result<()> {
    expect_size(backend, "logprob_terms", "the targets", targets.len(), rows)?;
    if let Some(t) = targets.iter().find(|&&t| t as usize >= vocab) {
        return Err(EngineError::Backend {
            backend,
            message: format!("logprob_terms: target {t} is past the {vocab} logits of a row"),
        });
    }
    expect_size(backend, "logprob_terms", "the output's rows", out.0, rows)?;
    expect_size(backend, "logprob_terms", "the output's columns", out.1, 2)
}

/// Refuses a [`LayerOps::softmax_totals`](crate::LayerOps::softmax_totals) call without a
/// temperature per row, with one that is not a finite number above 0, or whose output is not `rows
/// × 1`.
pub fn check_softmax_totals(
    backend: &'static str,
    rows: usize,
    temperatures: &[f32],
    out: (usize, usize),
) -> Result<()> {
    expect_size(
        backend,
        "softmax_totals",
        "the temperatures",
        temperatures.len(),
        rows,
    )?;
    if let Some(t) = temperatures.iter().find(|t| !(t.is_finite() && **t > 0.0)) {
        return Err(EngineError::Backend {
            backend,
            message: format!("softmax_totals: temperature {t} must be a finite number above 0"),
        });
    }
    expect_size(backend, "softmax_totals", "the output's rows", out.0, rows)?;
    expect_size(backend, "softmax_totals", "the output's columns", out.1, 1)
}

/// Refuses a [`LayerOps::walk_tails`](crate::LayerOps::walk_tails) call with a walk past the rows
/// of `logits` (`rows × vocab`), a head token past the row, a temperature that is no finite number
/// above 0, a cut its head reaches, or an output that is not `walks × 2`.
pub fn check_walk_tails(
    backend: &'static str,
    (rows, vocab): (usize, usize),
    walks: &[(usize, &TailWalk)],
    out: (usize, usize),
) -> Result<()> {
    for &(row, walk) in walks {
        let problem = if row >= rows {
            format!("row {row} of logits of {rows} rows")
        } else if let Some(t) = walk.head.iter().find(|&&t| t as usize >= vocab) {
            format!("head token {t} past a row of {vocab}")
        } else if let Some((t, _)) = walk.changed.iter().find(|&&(t, _)| t as usize >= vocab) {
            format!("changed token {t} past a row of {vocab}")
        } else if !(walk.temperature.is_finite() && walk.temperature > 0.0) {
            format!(
                "temperature {} is no finite number above 0",
                walk.temperature
            )
        } else if let Some(cut) = (walk.cut).filter(|c| !(c.head_mass < c.top_p && c.top_p <= 1.0))
        {
            format!(
                "a cut at top_p {} that its head's mass {} reaches, or past 1",
                cut.top_p, cut.head_mass
            )
        } else {
            continue;
        };
        return Err(EngineError::Backend {
            backend,
            message: format!("walk_tails: {problem}"),
        });
    }
    expect_size(
        backend,
        "walk_tails",
        "the output's rows",
        out.0,
        walks.len(),
    )?;
    expect_size(backend, "walk_tails", "the output's columns", out.1, 2)
}

/// Refuses an `op` on logits (`rows × vocab`) at a `(row, token)` of `places` past them.
pub fn check_logit_places(
    backend: &'static str,
    op: &str,
    (rows, vocab): (usize, usize),
    places: &[(u32, u32)],
) -> Result<()> {
    let past = |&&(r, t): &&(u32, u32)| r as usize >= rows || t as usize >= vocab;
    match places.iter().find(past) {
        Some((r, t)) => Err(EngineError::Backend {
            backend,
            message: format!("{op}: ({r}, {t}) is past logits of {rows} rows × {vocab}"),
        }),
        None => Ok(()),
    }
}

/// Refuses a [`LayerOps::pick_logits`](crate::LayerOps::pick_logits) call with a pick past `logits`
/// (`rows × vocab`), or whose output is not `picks × 1`.
pub fn check_pick_logits(
    backend: &'static str,
    dims: (usize, usize),
    picks: &[(u32, u32)],
    out: (usize, usize),
) -> Result<()> {
    check_logit_places(backend, "pick_logits", dims, picks)?;
    expect_size(
        backend,
        "pick_logits",
        "the output's rows",
        out.0,
        picks.len(),
    )?;
    expect_size(backend, "pick_logits", "the output's columns", out.1, 1)
}

//! Small numeric helpers shared by the benchmarks and caches.

/// The `q`-quantile (0..=1) of `xs` by nearest rank; NaN when empty.
pub fn quantile(xs: &[f64], q: f64) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n => v[((n - 1) as f64 * q).round() as usize],
    }
}

/// The median of `xs`; NaN when empty.
pub fn median(xs: &[f64]) -> f64 {
    quantile(xs, 0.5)
}

/// The arithmetic mean of `xs`; NaN when empty.
pub fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len() as f64
}

/// The geometric mean of `xs` (all positive); 1 when empty.
pub fn geomean(xs: impl IntoIterator<Item = f64>) -> f64 {
    let (sum, n) = xs
        .into_iter()
        .fold((0.0, 0), |(s, n), x| (s + x.ln(), n + 1));
    (sum / n.max(1) as f64).exp()
}

/// FNV-1a over `parts` (with a separator between them): a hash that stays the same across
/// builds and machines, for on-disk cache keys and for ranks comparing their configurations.
pub fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for part in parts {
        for &b in *part {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_by_nearest_rank() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(quantile(&[1.0, 2.0, 3.0, 4.0, 5.0], 0.9), 5.0);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn the_mean_counts_every_value() {
        assert_eq!(mean(&[1.0, 2.0, 9.0]), 4.0);
        assert!(mean(&[]).is_nan());
    }

    #[test]
    fn fnv1a_is_stable_and_separates_parts() {
        assert_eq!(fnv1a(&[b"a"]), fnv1a(&[b"a"]));
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
    }
}

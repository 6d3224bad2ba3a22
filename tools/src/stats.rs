//! The statistics every command reports with: nearest-rank percentiles and medians.

/// Nearest-rank percentile `q` (0..=1) of sorted values; 0 when empty.
pub(crate) fn percentile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The median of sorted values (the mean of the middle two for an even count); 0 when empty.
pub(crate) fn median_sorted(v: &[f64]) -> f64 {
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => f64::midpoint(v[n / 2 - 1], v[n / 2]),
    }
}

/// The median of any values; 0 when there are none.
pub(crate) fn median(values: impl IntoIterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.into_iter().collect();
    v.sort_by(f64::total_cmp);
    median_sorted(&v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        let v: Vec<u64> = (1..=1000).collect();
        assert_eq!(percentile(&v, 0.5), 500);
        assert_eq!(percentile(&v, 0.99), 990);
        assert_eq!(percentile(&v, 0.999), 999);
        assert_eq!(percentile(&[], 0.5), 0);
        assert_eq!(percentile(&[7], 0.999), 7);
    }

    #[test]
    fn medians_of_odd_even_and_no_values() {
        assert!((median([3.0, 1.0, 2.0]) - 2.0).abs() < 1e-12);
        assert!((median([4.0, 1.0, 2.0, 3.0]) - 2.5).abs() < 1e-12);
        assert!(median(std::iter::empty()).abs() < 1e-12);
        assert!((median_sorted(&[1.0, 5.0]) - 3.0).abs() < 1e-12);
    }
}

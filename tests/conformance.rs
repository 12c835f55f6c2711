//! The conformance suite on the CPU backend, 1 to 4 ranks.

use canopy_engine::conformance::run_suite;
use canopy_engine::CpuBackend;

#[test]
fn cpu_backend_passes_the_conformance_suite() {
    let results = run_suite(|_| Ok(CpuBackend), &[1, 2, 4], 0xC0FFEE, 6).expect("suite runs");
    assert!(results.len() >= 10 * 5 * 4 * 3);
    let failed: Vec<_> = results.iter().filter(|r| !r.passed).collect();
    assert!(
        failed.is_empty(),
        "{} of {} cases failed, e.g. {:?}",
        failed.len(),
        results.len(),
        failed.first()
    );
    // Fp32 storage must be far tighter than its bound: the CPU does the oracle's math in fp32.
    let worst = results.iter().map(|r| r.rel_error).fold(0.0, f64::max);
    assert!(worst < 1e-5, "worst relative error {worst}");
}

//! What the GPU tests share: a backend on GPU 0 or a skip, and a seeded generator whose seed
//! is printed (and taken from `CANOPY_TEST_SEED` to repeat a run).

use canopy_cuda::{CudaBackend, CudaError};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// A backend on GPU 0, or `None` (with a note) on a machine that cannot run one.
pub fn gpu(test: &str) -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(b) => Some(b),
        Err(e @ (CudaError::NoDriver | CudaError::NoDevice(_) | CudaError::NoNvrtc)) => {
            eprintln!("{test}: skipped, no GPU to run on ({e})");
            None
        }
        Err(e) => panic!("{test}: creating the CUDA backend: {e}"),
    }
}

/// A generator seeded from `CANOPY_TEST_SEED`, or the clock (printed either way).
pub fn rng(test: &str) -> ChaCha8Rng {
    let seed = std::env::var("CANOPY_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
        });
    eprintln!("{test}: CANOPY_TEST_SEED={seed}");
    ChaCha8Rng::seed_from_u64(seed)
}

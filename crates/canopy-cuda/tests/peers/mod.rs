//! What the tests of the peer paths share: the GPUs whose memory every other reaches.

/// The GPUs a test of the peer paths may use (up to 4, all reaching each other's memory,
/// NCCL present), or `None` with the reason it cannot run here.
pub fn gpus(test: &str) -> Option<usize> {
    super::common::gpu(test)?;
    let count = match canopy_cuda::probe::device_count() {
        Ok(n) => n.min(4),
        Err(e) => {
            eprintln!("{test}: skipped, no GPU ({e})");
            return None;
        }
    };
    if count < 2 || !canopy_cuda::probe::nccl_present() {
        eprintln!("{test}: skipped, it needs two GPUs and NCCL ({count} GPUs visible)");
        return None;
    }
    let peer = |a: usize, b: usize| {
        let (da, db) = (
            cudarc::driver::result::device::get(a as i32).expect("a visible GPU"),
            cudarc::driver::result::device::get(b as i32).expect("a visible GPU"),
        );
        let mut can = 0;
        // SAFETY: two valid devices; `can` is written.
        unsafe { cudarc::driver::sys::cuDeviceCanAccessPeer(&mut can, da, db) }
            .result()
            .expect("cuDeviceCanAccessPeer");
        can != 0
    };
    if !(0..count).all(|a| (0..count).all(|b| a == b || peer(a, b))) {
        eprintln!("{test}: skipped, these GPUs do not reach each other's memory");
        return None;
    }
    Some(count)
}

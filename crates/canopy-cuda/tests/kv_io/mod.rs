//! KV in and out of the device for the transport tests: random K and V on the host, and a KV's
//! logical tokens read back through a host collective.

use canopy_comm::Collective;
use canopy_core::{AttnShape, DType, TypedVec};
use canopy_cuda::{CudaBackend, CudaKv};
use canopy_engine::{Backend, Result};
use rand::Rng;

/// Random K and V of `tokens` tokens of `shape` in `dtype`.
pub fn random_kv(
    rng: &mut impl Rng,
    shape: &AttnShape,
    dtype: DType,
    tokens: usize,
) -> [TypedVec; 2] {
    let n = tokens * shape.kv_token_elems();
    [(); 2].map(|_| {
        let x: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        TypedVec::from_f32(dtype, &x)
    })
}

/// Logical tokens `0..tokens` of `kv`, K and V, read through the host (a send to this rank
/// itself).
pub fn read_kv<C: Collective>(
    b: &CudaBackend,
    comm: &C,
    kv: &CudaKv,
    tokens: usize,
    token_bytes: usize,
) -> Result<(Vec<u8>, Vec<u8>)> {
    b.send_kv(kv, tokens, comm, comm.rank())?;
    let (mut k, mut v) = (
        vec![0u8; tokens * token_bytes],
        vec![0u8; tokens * token_bytes],
    );
    comm.recv(&mut k, comm.rank())?;
    comm.recv(&mut v, comm.rank())?;
    Ok((k, v))
}

//! What makes the CUDA backend's recorded decode passes stale: its graph epoch moves when a
//! buffer that a recording reads is made anew, and only then. A model's shared page table is
//! made with room for a table as long as the pool, and the inputs only a prefill reads grow
//! outside the epoch, so neither drops a server's kept recordings as requests join.
//!
//! Without a GPU (no driver, no device, no NVRTC) the test prints why and passes.

mod common;
mod compare;
use common::{gpu, rng};
use compare::values;

use canopy_core::{AttnShape, DType};
use canopy_engine::{Backend, KeyBlock, LayerOps};

const PAGE: u32 = 16;

#[test]
fn buffers_with_room_or_unread_by_recordings_keep_the_graph_epoch() {
    let Some(gpu) = gpu("buffers_with_room_or_unread_by_recordings_keep_the_graph_epoch") else {
        return;
    };
    let b = gpu.with_paging(PAGE).unwrap();
    let epoch = || b.graph_epoch().expect("the CUDA backend records passes");
    let shape = AttnShape::new(8, 2, 64).unwrap();
    let pages = 64u32;
    let mut kvs: Vec<_> = (0..2)
        .map(|_| {
            b.alloc_kv(&shape, DType::F32, (pages * PAGE) as usize)
                .unwrap()
        })
        .collect();
    // Logical pages past the pool's count map onto its pages again (a tree's growth room).
    let table = |len: u32| (0..len).map(|i| (i * 5 + 1) % pages).collect::<Vec<u32>>();
    b.set_page_tables(&mut kvs, &table(3)).unwrap();
    let before = epoch();
    b.set_page_tables(&mut kvs, &table(pages)).unwrap();
    assert_eq!(
        epoch(),
        before,
        "a table grown to the pool's length is written in place"
    );
    b.set_page_tables(&mut kvs, &table(3 * pages)).unwrap();
    assert!(
        epoch() > before,
        "a table past the pool's length makes its buffer anew"
    );

    // A prefill's attention over more keys than a decode step's inputs hold at first.
    let keys = 600;
    let positions: Vec<u32> = (0..keys as u32).collect();
    let (q_elems, kv_elems) = (shape.q_row_elems(), shape.kv_token_elems());
    let mut rng = rng("buffers_with_room_or_unread_by_recordings_keep_the_graph_epoch");
    let q = b
        .upload_tensor(&values(&mut rng, q_elems, 1.0), 1, q_elems)
        .unwrap();
    let k = values(&mut rng, keys * kv_elems, 1.0);
    let k = b.upload_tensor(&k, keys, kv_elems).unwrap();
    let mut states = b.empty_states(&shape, 1).unwrap();
    let block = KeyBlock {
        k: &k,
        v: &k,
        positions: &positions,
        dtype: DType::F32,
    };
    let before = epoch();
    b.causal_attention(&shape, &q, &[keys as u32], block, &mut states)
        .unwrap();
    assert_eq!(
        epoch(),
        before,
        "a prefill's own inputs grow outside the epoch"
    );
    // A step staged with as many rows grows the inputs a recording reads.
    b.stage_step(&vec![1; keys], &positions, &[]).unwrap();
    assert!(
        epoch() > before,
        "the inputs a recording reads move the epoch when made anew"
    );
}

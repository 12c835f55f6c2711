//! Weights larger than the upload's page-locked staging buffers land whole: every row of an
//! embedding table that spans several buffers (and ends inside one) is read back by the
//! embedding lookup, bit for bit, in every dtype.
//!
//! Without a GPU every test prints why and passes. The seed is printed; `CANOPY_TEST_SEED`
//! repeats a run.

mod common;

use common::{gpu, rng};

use canopy_core::{DType, TypedVec};
use canopy_engine::LayerOps;
use rand::Rng;

#[test]
fn a_weight_larger_than_the_staging_buffers_lands_whole() {
    let test = "a_weight_larger_than_the_staging_buffers_lands_whole";
    let Some(b) = gpu(test) else { return };
    let mut rng = rng(test);
    // 41 MiB and a row in f32: two whole 16 MiB buffers and a part of a third, whose last
    // piece ends in the middle of a row.
    let cols = 1000;
    let rows = (41 << 20) / (cols * 4) + 1;
    // Magnitudes from 0.05 to 1 of either sign: never zero, so a byte not copied shows.
    let table: Vec<f32> = (0..rows * cols)
        .map(|_| rng.gen_range(0.05f32..1.0) * if rng.gen() { 1.0 } else { -1.0 })
        .collect();
    // Every row of the table's first and last 64, and a spread of the rest.
    let ids: Vec<u32> = (0..64)
        .chain(rows - 64..rows)
        .chain((0..rows).step_by(97))
        .map(|r| r as u32)
        .collect();
    for dtype in [DType::F32, DType::Bf16, DType::F16] {
        let data = TypedVec::from_f32(dtype, &table);
        let want_all = data.to_f32_vec();
        let weight = b.upload_weight(&data, rows, cols).unwrap();
        let poison = vec![f32::NAN; ids.len() * cols];
        let mut out = b.upload_tensor(&poison, ids.len(), cols).unwrap();
        b.embed(&weight, &ids, &mut out).unwrap();
        let got = b.download_tensor(&out).unwrap();
        for (i, &id) in ids.iter().enumerate() {
            let row = id as usize;
            assert_eq!(
                got[i * cols..(i + 1) * cols],
                want_all[row * cols..(row + 1) * cols],
                "{dtype} row {row}"
            );
        }
    }
}

//! Weights larger than the upload's page-locked staging buffers land whole: every row of an
//! embedding table that spans several buffers (and ends inside one) is read back by the
//! embedding lookup, bit for bit, in every dtype, whether the upload copies a host vector or
//! asks its reader for the parts (then read on another backend's stream once the uploads have
//! finished). A reader's error comes back as it was, and the next upload works.
//!
//! Without a GPU every test prints why and passes. The seed is printed; `CANOPY_TEST_SEED`
//! repeats a run.

mod common;

use common::{gpu, rng};

use canopy_core::{DType, TypedVec};
use canopy_engine::{EngineError, LayerOps};
use rand::Rng;

#[test]
fn a_weight_larger_than_the_staging_buffers_lands_whole() {
    let test = "a_weight_larger_than_the_staging_buffers_lands_whole";
    let (Some(b), Some(other)) = (gpu(test), gpu(test)) else {
        return;
    };
    let mut rng = rng(test);
    // 100 MiB and a row in f32: three whole 32 MiB buffers and a part of a fourth, whose
    // last piece ends in the middle of a row.
    let cols = 1000;
    let rows = (100 << 20) / (cols * 4) + 1;
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
    for (dtype, by_parts) in [
        (DType::F32, false),
        (DType::Bf16, false),
        (DType::F16, false),
        (DType::F32, true),
        (DType::Bf16, true),
    ] {
        let data = TypedVec::from_f32(dtype, &table);
        let want_all = data.to_f32_vec();
        // Uploaded by parts, the weight is read on another backend's stream once the uploads
        // have finished, as a rank sharing the GPU reads it.
        let (weight, reader) = if by_parts {
            let weight = upload_by_parts(&b, &data, rows, cols);
            b.finish_uploads().unwrap();
            (weight, &other)
        } else {
            (b.upload_weight(&data, rows, cols).unwrap(), &b)
        };
        let poison = vec![f32::NAN; ids.len() * cols];
        let mut out = reader.upload_tensor(&poison, ids.len(), cols).unwrap();
        reader.embed(&weight, &ids, &mut out).unwrap();
        let got = reader.download_tensor(&out).unwrap();
        for (i, &id) in ids.iter().enumerate() {
            let row = id as usize;
            assert_eq!(
                got[i * cols..(i + 1) * cols],
                want_all[row * cols..(row + 1) * cols],
                "{dtype} row {row}, by parts: {by_parts}"
            );
        }
    }
}

/// `data` uploaded by [`LayerOps::upload_weight_with`], each part copied from it, after
/// checking that the parts cover the weight in order.
fn upload_by_parts(
    b: &canopy_cuda::CudaBackend,
    data: &TypedVec,
    rows: usize,
    cols: usize,
) -> canopy_cuda::CudaWeight {
    let (bytes, width) = (data.as_bytes(), data.dtype().size_bytes());
    let mut next = 0;
    let weight = b
        .upload_weight_with(data.dtype(), (rows, cols), &mut |first, mut part| {
            assert_eq!(
                (first, part.dtype()),
                (next, data.dtype()),
                "parts in order"
            );
            next += part.len();
            let to = part.as_bytes_mut();
            to.copy_from_slice(&bytes[first * width..first * width + to.len()]);
            Ok::<(), EngineError>(())
        })
        .unwrap();
    assert_eq!(next, rows * cols, "the parts cover the weight");
    weight
}

#[test]
fn a_readers_error_ends_its_upload_and_the_next_works() {
    let test = "a_readers_error_ends_its_upload_and_the_next_works";
    let Some(b) = gpu(test) else { return };
    let (rows, cols) = (3 << 20, 16);
    let failed = b.upload_weight_with(DType::Bf16, (rows, cols), &mut |first, _| {
        if first > 0 {
            return Err(EngineError::Backend {
                backend: "test",
                message: "the reader failed".into(),
            });
        }
        Ok(())
    });
    let err = failed.err().expect("the reader's error").to_string();
    assert!(err.contains("the reader failed"), "{err}");
    let values = TypedVec::from_f32(DType::F32, &[0.5, -1.5, 2.0, 0.25]);
    let weight = b.upload_weight(&values, 2, 2).unwrap();
    let mut out = b.upload_tensor(&[f32::NAN; 4], 2, 2).unwrap();
    b.embed(&weight, &[1, 0], &mut out).unwrap();
    assert_eq!(b.download_tensor(&out).unwrap(), [2.0, 0.25, 0.5, -1.5]);
}

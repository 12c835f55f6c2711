//! Cross-crate integration tests for canopy live beside this file: `conformance.rs` (the
//! backend suite on the CPU) and `properties.rs` (proptest over random trees, shapes, planners,
//! strategies and rank counts). The `canopy` binary's tests are in `crates/canopy-cli/tests`,
//! where cargo hands them the built binary.

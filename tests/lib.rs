//! Integration tests for canopy live beside this file: `conformance.rs` (the backend suite on
//! the CPU), `properties.rs` (proptest over random trees, shapes, planners, strategies and
//! rank counts) and `cli.rs` (the `canopy` binary, including bad input).

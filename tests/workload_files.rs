//! The workload files users copy from: the README's explicit-tree example is the shipped
//! `configs/workloads/example-explicit.toml`, word for word, and both build the tree they
//! describe.

use canopy_core::WorkloadSpec;

const README: &str = include_str!("../README.md");
const EXAMPLE: &str = include_str!("../configs/workloads/example-explicit.toml");

/// The README's first ```toml block.
fn readme_toml() -> &'static str {
    let start = README
        .find("```toml\n")
        .expect("the README shows a TOML workload")
        + "```toml\n".len();
    let len = README[start..].find("```").expect("the block is closed");
    &README[start..start + len]
}

#[test]
fn the_readme_example_is_the_shipped_file_and_parses() {
    assert_eq!(
        readme_toml(),
        EXAMPLE,
        "README and example-explicit.toml differ"
    );
    let spec = WorkloadSpec::parse("example-explicit", readme_toml()).expect("the example parses");
    let tree = spec.build_tree().expect("the example builds a tree");
    assert_eq!(tree.num_queries(), 4);
    assert_eq!(tree.total_tokens(), 2048 + 512 + 768 + 40 + 25 + 64 + 16);
    assert_eq!(spec.shape.q_heads, 32);
}

#[test]
fn the_shipped_example_loads_by_path() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../configs/workloads/example-explicit.toml"
    );
    let spec = WorkloadSpec::load(path).expect("a workload file loads by path");
    assert_eq!(spec.build_tree().unwrap().num_queries(), 4);
}

//! Helpers the integration tests share (each test file uses some of them).
#![allow(dead_code)]

use assert_cmd::Command;

/// The `canopy` binary this package built.
pub fn canopy() -> Command {
    Command::cargo_bin("canopy").expect("the canopy binary is built")
}

/// The path of the tiny random Llama `variant` of `tests/fixtures/tiny/`.
pub fn tiny_model(variant: &str) -> String {
    format!(
        "{}/../../tests/fixtures/tiny/{variant}",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// The path of SmolLM2-135M-Instruct, by [`canopy_model::default_model_for_tests`]'s rule;
/// `None` where the tests that need it say so and pass.
pub fn smollm2_path() -> Option<std::path::PathBuf> {
    canopy_model::default_model_for_tests().expect("fetching SmolLM2")
}

/// What `cmd` prints on success, parsed as JSON.
pub fn json_output(cmd: &mut Command) -> serde_json::Value {
    let out = cmd.assert().success().get_output().stdout.clone();
    serde_json::from_slice(&out).expect("valid JSON")
}

/// Whether plot labels can be drawn here: `CANOPY_FONT`, or one of the fonts `canopy` looks
/// for without it.
pub fn font() -> bool {
    std::env::var_os("CANOPY_FONT").is_some()
        || [
            "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
            "/usr/share/fonts/TTF/DejaVuSans.ttf",
        ]
        .into_iter()
        .any(|f| std::path::Path::new(f).exists())
}
pub mod serve;
